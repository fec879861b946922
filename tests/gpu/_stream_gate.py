"""A CUDA stream held at a point until the test releases it, to make a stream "hang" for as long as a test
needs: the stream waits (cuStreamWaitValue32, a stream memory operation of the driver) for a device flag
that release() sets from another stream. Work queued behind the gate starts only after the release.

CUDA loads kernels lazily by default (CUDA_MODULE_LOADING=LAZY), and loading one may synchronize the context,
which waits for the held stream: a kernel first launched while the gate holds (release()'s own fill, or one
queued behind the gate) would deadlock the device. So the gate runs its release kernel once when made, and a
test runs every kernel it queues behind the gate once before hold()."""

import ctypes

import torch

CU_STREAM_WAIT_VALUE_GEQ = 0x0


class StreamGate:
    def __init__(self, device: int = 0):
        self.device = torch.device("cuda", device)
        self.flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.stream = torch.cuda.Stream(self.device)   # the stream that is held
        self._setter = torch.cuda.Stream(self.device)  # the stream that releases it
        with torch.cuda.stream(self._setter):  # release()'s kernel, loaded now (see above)
            self.flag.fill_(1)
            self.flag.fill_(0)
        torch.cuda.synchronize(self.device)  # the flag is zero before any stream waits on it
        wait = ctypes.CDLL("libcuda.so.1").cuStreamWaitValue32_v2
        wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        wait.restype = ctypes.c_int
        self._wait = wait
        self.held = False

    def hold(self) -> None:
        """Everything queued on `stream` from now on waits for release()."""
        rc = self._wait(self.stream.cuda_stream, self.flag.data_ptr(), 1, CU_STREAM_WAIT_VALUE_GEQ)
        assert rc == 0, f"cuStreamWaitValue32_v2 failed with CUresult {rc}"
        self.held = True

    def release(self) -> None:
        with torch.cuda.stream(self._setter):
            self.flag.fill_(1)
        self.held = False

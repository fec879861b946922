"""torch's cuBLAS workspaces stay while an in-process vLLM engine lives: its CUDA graphs, captured in the
trainer's process, write into the workspace of the stream they were captured on at every replay, so the
trainer's offload must not free it (it did: the next decode graph faulted). Without such an engine the
offload frees them as before."""
import torch

from colomem import _torch
from colomem.engines.deepspeed.state import release_cached_memory
from fakes.vllm import make
from fakes.vllm import fake_vllm  # noqa: F401  (autouse: vLLM's modules stubbed)


def _count_clears(monkeypatch) -> list:
    cleared: list = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(1), raising=False)
    return cleared


def test_the_offload_frees_the_workspaces_unless_an_owner_of_graphs_holds_them(monkeypatch):
    cleared = _count_clears(monkeypatch)
    release_cached_memory()
    assert len(cleared) == 1
    a, b = object(), object()
    _torch.hold_cublas_workspaces(a)
    _torch.hold_cublas_workspaces(b)
    try:
        release_cached_memory()
        assert not _torch.clear_cublas_workspaces() and len(cleared) == 1
        _torch.let_go_cublas_workspaces(a)
        release_cached_memory()                 # b still holds them
        assert len(cleared) == 1
    finally:
        _torch.let_go_cublas_workspaces(a)
        _torch.let_go_cublas_workspaces(b)
    assert _torch.clear_cublas_workspaces() and len(cleared) == 2


def test_an_in_process_engine_holds_them_from_its_start_to_its_close(monkeypatch):
    cleared = _count_clears(monkeypatch)
    across = make()                             # vLLM in a process of its own: its graphs are not here
    release_cached_memory()
    assert len(cleared) == 1
    inside = make(engine_in_process=True, sync_transport="direct")
    release_cached_memory()
    assert len(cleared) == 1
    inside.close()
    release_cached_memory()
    assert len(cleared) == 2
    across.close()

"""Markers skip with a reason that names what is missing (a GPU, the CUDA build, vLLM, DeepSpeed)."""

import importlib.util

import pytest


def _cuda_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    from colomem import _C

    if not _C.build_info()["cuda"]:
        return "colomem._C is the host-only build (no nvcc at build time)"
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    return None


def pytest_collection_modifyitems(config, items):
    cuda = _cuda_reason()
    missing = {}
    for mod in ("vllm", "deepspeed"):
        if importlib.util.find_spec(mod) is None:
            missing[mod] = f"{mod} is not installed (pip install 'colomem[gpu]' brings the tested version)"
    ngpu = 0
    if cuda is None:
        import torch

        ngpu = torch.cuda.device_count()
    for item in items:
        # markers, not keywords: keywords also hold the names of the folders above the test (a checkout in a
        # folder called "vllm" would otherwise skip every test)
        kw = {m.name for m in item.iter_markers()}
        if ("gpu" in kw or "ipc" in kw or "multi_gpu" in kw) and cuda:
            item.add_marker(pytest.mark.skip(reason=cuda))
        elif "multi_gpu" in kw and ngpu < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA devices, {ngpu} visible"))
        for mod, reason in missing.items():
            if mod in kw:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def job_env(tmp_path_factory, monkeypatch):
    """A run's environment for CPU job tests: the config-built model cached once for the session's tests,
    no torch.distributed variables from an earlier test."""
    monkeypatch.setenv("COLOMEM_CACHE", str(tmp_path_factory.getbasetemp() / "colomem-cache-jobs"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)

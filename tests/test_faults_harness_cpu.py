"""The fault harness's readers (benchmarks/faults.py, job_procs.py): what it takes for the line a user reads,
and the GPU memory check's wait for the driver to drop a dead process's context."""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import faults  # noqa: E402
import job_procs  # noqa: E402


def test_the_trainer_watch_line_is_read_through_vllms_engine_prefix():
    line = ("(EngineCore pid=2597) [colomem] the trainer process 2512 that started this vLLM engine is gone "
            "(killed?); shutting the engine down (pid 2597) so its GPU memory is freed")
    assert faults.ERROR_LINE.search(line)
    assert re.search(faults.FAULTS["trainer_sync"].expect, line)
    assert not faults.ERROR_LINE.search("(EngineCore pid=1) INFO reset prefix cache")
    assert faults.ERROR_LINE.search("error: PeerError: the weight sync to vLLM failed")


def test_gpu_memory_counts_as_released_once_the_driver_stops_listing_the_process(monkeypatch):
    answers = [{7: 29080, 9: 100}, {7: 29080, 9: 100}, {9: 100}]
    monkeypatch.setattr(job_procs, "gpu_apps", lambda: answers.pop(0) if len(answers) > 1 else answers[0])
    monkeypatch.setattr(job_procs.time, "sleep", lambda s: None)
    apps, waited = job_procs.wait_gpu_released({7}, timeout_s=10)
    assert apps == {9: 100} and waited is not None


def test_gpu_memory_still_held_at_the_deadline_is_reported(monkeypatch):
    monkeypatch.setattr(job_procs, "gpu_apps", lambda: {7: 29080})
    apps, waited = job_procs.wait_gpu_released({7}, timeout_s=0.0)
    assert apps == {7: 29080} and waited is None


def test_without_nvidia_smi_there_is_nothing_to_wait_for(monkeypatch):
    monkeypatch.setattr(job_procs, "gpu_apps", lambda: None)
    assert job_procs.wait_gpu_released({7}, timeout_s=10) == (None, None)

"""The runner with --shared-base on a real GPU (vLLM in the trainer's process, DeepSpeed ZeRO-2, peft): a LoRA
job on the default job's model whose trainer holds no copy of the base, every step's checksum of the base and
the full one at the end unchanged, the adapter served to vLLM (the rollout samples with the trainer's
weights), and vLLM's weights never slept (only its KV cache).

Run: python -m pytest -m "gpu and vllm and deepspeed" -s tests/gpu/test_shared_base_runner_gpu.py
"""
import pytest

from test_grpo_runner_gpu import _run

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.deepspeed, pytest.mark.slow]
STEPS = 6


def test_a_shared_base_lora_job_runs_on_one_copy_of_its_base(tmp_path):
    steps, summary, log = _run(tmp_path, "shared", "--lora", "--lora-r", "8", "--shared-base", "--steps",
                               str(STEPS), "--offload", "all", "--rollout-sleep", "always")
    assert summary["status"] == "ok" and len(steps) == STEPS, log[-4000:]
    sb = summary["shared_base"]
    assert sb["lora_base_copies_on_gpu"] == 1 and sb["checks"] == STEPS and not sb["not_mapped"], sb
    for s in steps:
        assert s["train/rollout_logprob_gap"] < 0.05, s["train/rollout_logprob_gap"]
        assert "wake_weights_s" not in {k.split("/", 1)[-1] for k in s if k.startswith("rollout/")}
        assert s["shared_base/bytes"] == sb["bytes_shared"]
        # the trainer's offload moved its optimizer state, never the base (it is vLLM's memory)
        moved = s.get("trainer_offload/moved_bytes")
        assert moved is None or moved < sb["bytes_shared"], (moved, sb["bytes_shared"])
    assert [s["weight_version"] for s in steps] == list(range(1, STEPS + 1))


def test_a_merged_rollout_on_the_shared_base_gives_the_base_back_every_step(tmp_path):
    """--shared-base-rollout merged: vLLM runs without its LoRA support and decodes from the base with the
    adapter merged into it; after every rollout the adapted weights come back from their host copy (in the
    job's pinned pool), which each step's sampled checksum and the full one at the end check."""
    steps, summary, log = _run(tmp_path, "merged", "--lora", "--lora-r", "8", "--shared-base",
                               "--shared-base-rollout", "merged", "--steps", str(STEPS))
    assert summary["status"] == "ok" and len(steps) == STEPS, log[-4000:]
    sb = summary["shared_base"]
    assert sb["rollout"] == "merged" and sb["restores"] == STEPS and sb["checks"] == STEPS, sb
    # the tiny job leaves room for the adapted weights' copy on the GPU: from the second step the base comes
    # back from it (the full checksum at the end still finds every byte of the base as it was shared)
    assert sb["restore_copy"] == "gpu" and "comes back from a copy in GPU memory" in log, sb
    assert "enable_lora': True" not in log                       # vLLM serves no adapter
    for s in steps:
        # the rollout sampled with the trainer's weights: the merge reached vLLM
        assert s["train/rollout_logprob_gap"] < 0.05, s["train/rollout_logprob_gap"]
        assert 0 < s["shared_base/restore_bytes"] < sb["bytes_shared"] and s["shared_base/restore_s"] > 0
    assert [s["weight_version"] for s in steps] == list(range(1, STEPS + 1))

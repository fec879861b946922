"""The memory-budget calculator: per-phase arithmetic, ZeRO sharding, LoRA, the offload advice, the CLI."""
import json

import pytest

from colomem.budget import GiB, Budget, estimate, lora_params, main, shape_for


def _items(items):
    return {i.name: i.bytes for i in items}


def test_full_finetune_state_is_14_bytes_per_param_on_one_gpu():
    b = estimate(1e9, zero=2, gpus=1, kv_gib=10)
    st = _items(b.trainer_state)
    assert st == {"params (bf16)": 2e9, "fp32 master": 4e9, "Adam m+v (fp32)": 8e9}
    tr = _items(b.train)
    assert tr["grads (bf16)"] == 2e9
    assert b.to_dict()["pinned_host_per_gpu_gib"] == pytest.approx(14e9 / GiB, rel=1e-3)


@pytest.mark.parametrize("zero,params_div,grads_div,opt_div", [(0, 1, 1, 1), (1, 1, 1, 4), (2, 1, 4, 4),
                                                               (3, 4, 4, 4)])
def test_zero_stages_shard_what_they_should(zero, params_div, grads_div, opt_div):
    b = estimate(1e9, zero=zero, gpus=4, kv_gib=10)
    st, tr = _items(b.trainer_state), _items(b.train)
    assert st["params (bf16)"] == pytest.approx(2e9 / params_div)
    assert st["fp32 master"] == pytest.approx(4e9 / opt_div)
    assert st["Adam m+v (fp32)"] == pytest.approx(8e9 / opt_div)
    assert tr["grads (bf16)"] == pytest.approx(2e9 / grads_div)


def test_lora_trains_only_the_adapter():
    shape = shape_for(1.54e9)
    assert (shape.hidden, shape.layers, shape.kv_dim, shape.intermediate) == (1536, 28, 256, 8960)
    A = lora_params(shape, 8)
    # q, k, v, o, gate, up, down: r * (in + out) each, per layer
    per_layer = 8 * ((1536 + 1536) + 2 * (1536 + 256) + (1536 + 1536) + 2 * (1536 + 8960) + (8960 + 1536))
    assert A == per_layer * 28
    b = estimate(1.54e9, lora=True, lora_r=8, kv_gib=10)
    st = _items(b.trainer_state)
    assert st["frozen base (bf16)"] == pytest.approx(2 * 1.54e9)
    assert st["adapter fp32 master"] == pytest.approx(4 * A) and st["adapter Adam m+v"] == pytest.approx(8 * A)
    assert _items(b.train)["grads (bf16)"] == pytest.approx(2 * A)


def test_rollout_phase_and_suggested_utilisation():
    b = estimate(1e9, kv_gib=20, gpu_gib=80, tp=1)
    r = _items(b.rollout)
    assert r["vLLM weights (bf16)"] == 2e9 and r["KV cache"] == 20 * GiB
    want = (2e9 + 20 * GiB + 2 * GiB) / (80 * GiB) + 0.01
    assert b.suggested_gpu_memory_utilization == pytest.approx(want, abs=1e-3)
    b2 = estimate(1e9, kv_gib=20, gpu_gib=80, tp=2, gpus=2)
    assert _items(b2.rollout)["vLLM weights (bf16)"] == 1e9


def test_kv_from_tokens():
    s = shape_for(7.62e9)
    b = estimate(7.62e9, kv_tokens=1000)
    assert _items(b.rollout)["KV cache"] == pytest.approx(2 * s.layers * s.kv_dim * 2 * 1000)


def test_offload_advice_names_the_smallest_sufficient_set():
    # 7B full FT on 141 GiB with a 40 GiB KV cache: state 91 GiB; Adam alone (52 GiB) is enough to offload
    b = estimate(7e9, kv_gib=40, micro_batch=4, seq_len=2048)
    assert b.fits and b.offload == ["Adam m+v (fp32)"]
    assert any("offload at least: Adam m+v" in a for a in b.advice)
    # a bigger KV cache needs the master weights out too
    b = estimate(7e9, kv_gib=90, micro_batch=4, seq_len=2048)
    assert b.offload == ["Adam m+v (fp32)", "fp32 master"]


def test_does_not_fit_says_what_to_change():
    b = estimate(14e9, kv_gib=20, gpu_gib=80, micro_batch=8, seq_len=4096, grad_ckpt=False)
    assert not b.train_fits and not b.fits
    advice = " ".join(b.advice)
    assert "gradient checkpointing" in advice and "--micro-batch" in advice and "LoRA" in advice
    b = estimate(70e9, kv_gib=60, gpu_gib=141)
    assert not b.rollout_fits and "tensor parallel" in " ".join(b.advice)
    b = estimate(7e9, kv_gib=10, host_gib=32)
    assert any("host RAM" in a for a in b.advice)


def test_bad_inputs():
    with pytest.raises(ValueError):
        estimate(-1)
    with pytest.raises(ValueError):
        estimate(1e9, gpus=1, tp=2)


def test_cli(capsys):
    assert main(["--params", "7e9", "--lora", "--zero", "2", "--kv-gib", "20", "--gpus", "1",
                 "--gpu-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "rollout phase" in out and "train phase" in out and "answer: fits" in out
    assert main(["--params", "70e9", "--kv-gib", "60", "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is False and d["rollout_total_gib"] > d["gpu_gib"]
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--tp", "4"])
    assert Budget.total([]) == 0


def test_bridge_buffers_count_in_both_phases():
    b = estimate(7e9, kv_gib=40)
    assert _items(b.rollout)["weight bridge buffers"] == GiB and _items(b.train)["weight bridge buffers"] == GiB
    big = estimate(7e9, kv_gib=40, bridge_gib=8)   # 4 GiB buckets x 2
    assert Budget.total(big.rollout) - Budget.total(b.rollout) == pytest.approx(7 * GiB)
    assert _items(estimate(7e9, kv_gib=40, bridge_gib=0).rollout)["weight bridge buffers"] == 0
    with pytest.raises(ValueError):
        estimate(7e9, bridge_gib=-1)


def test_the_budget_predicts_the_runners_placement():
    from colomem.budget import estimate

    small = estimate(1.54e9, kv_gib=36, micro_batch=8, seq_len=768, gpu_gib=139.8)
    assert small.placement["label"] == "nothing moves" and small.to_dict()["placement"] == small.placement
    big = estimate(7.6e9, kv_gib=20, micro_batch=2, seq_len=768, gpu_gib=139.8)
    # vLLM + the trainer's peak do not fit together, the whole state beside the awake rollout neither: the
    # Adam moments go first
    assert big.placement["rollout_sleeps"] and "optim" not in big.placement["keep"]
    assert "master" in big.placement["keep"] and "params" in big.placement["keep"]
    assert any("56.6 GiB per GPU with that placement" in a for a in big.advice)


def test_a_shared_base_is_counted_once_and_stays_through_training():
    two = estimate(7.6e9, lora=True, kv_gib=20)
    one = estimate(7.6e9, lora=True, kv_gib=20, shared_base=True)
    assert "frozen base (bf16)" not in _items(one.trainer_state)
    assert _items(one.train)["vLLM weights = the shared base (bf16)"] == pytest.approx(2 * 7.6e9)
    assert _items(one.rollout)["weight bridge buffers"] == 0          # the in-process sync needs none
    # nothing moving: one copy of the base fewer (and no bridge buffers) than the two-copy job
    need = lambda b: float(b.placement["why"].split("needs ")[1].split(" GiB")[0])  # noqa: E731
    saved = need(two) - need(one)
    assert saved == pytest.approx((2 * 7.6e9 + 1 * GiB) / GiB, rel=0.01)
    with pytest.raises(ValueError, match="shared base"):
        estimate(7.6e9, kv_gib=20, shared_base=True)                   # a full fine-tune has no frozen base
    with pytest.raises(ValueError, match="shared base"):
        estimate(7.6e9, lora=True, zero=3, kv_gib=20, shared_base=True)


def test_the_big_kv_benchmark_job_must_move_the_adam_moments():
    # configs/grpo_1p5b_bigkv.yaml: vLLM takes 85 % of the H200, so the trainer cannot stay whole beside it
    b = estimate(1.54e9, kv_gib=112, micro_batch=8, seq_len=512, gpu_gib=139.8)
    assert b.placement["keep"] == ["params", "other", "grads", "master"] and b.placement["rollout_sleeps"]
    assert "did not fit: nothing moves, trainer resident" in b.placement["why"]
    # the shipped benchmark config (0.85 of the GPU) is the job this estimate describes
    from colomem.runner.config import load_run_config
    from pathlib import Path

    cfg = load_run_config(["--config", str(Path(__file__).resolve().parents[1] / "configs/grpo_1p5b_bigkv.yaml")])
    assert cfg.gpu_memory_utilization * 139.8 >= 112 + 2 and cfg.switch == "colomem" and cfg.offload == "auto"


def test_the_optimizer_steps_own_peak_decides_when_the_moments_come_back():
    """ZeRO-2's step casts the gradients to fp32 beside them before it frees them: with Adam's moments
    resident too, a 7.6B full fine-tune needs more than a 139.8 GiB GPU, so the budget brings the moments back
    inside the step (as the runner's --optimizer-reload auto does), and says so."""
    b = estimate(7.6e9, kv_gib=20, micro_batch=2, seq_len=768, gpu_gib=139.8)
    names = {i.name for i in b.train}
    assert b.optimizer_reload == "step" and b.train_fits
    assert "Adam m+v (fp32), back inside the optimizer step" in names and "grads (bf16)" not in names
    assert "optimizer step: grads cast to fp32" in names
    assert any("brought back inside it" in a for a in b.advice)
    assert b.placement is not None and "optim" not in b.placement["keep"] and b.to_dict()["optimizer_reload"] == "step"
    # with the moments resident the step would need gradients, their flat copy and their fp32 cast together
    resident = sum(i.bytes for i in b.trainer_state) + 2 * 7.6e9 * (1 + 1 + 2)
    assert resident > 139.8 * GiB > Budget.total(b.train)
    # a 1.5B job fits with everything resident: its step's peak is listed, the moments stay where they are
    small = estimate(1.5e9, micro_batch=8, seq_len=512, gpu_gib=139.8)
    assert small.optimizer_reload == "overlap" and small.train_fits
    assert {"Adam m+v (fp32)", "optimizer step: grads flattened (bf16)"} <= {i.name for i in small.train}
    assert not any("brought back inside it" in a for a in small.advice)


def test_checkpointing_every_kth_layer_keeps_the_others_activations():
    from colomem.budget import activation_bytes, checkpointed_layers

    s = shape_for(1.5e9)
    bsh = 8 * 261 * s.hidden
    assert checkpointed_layers(s.layers, True, 1) == s.layers and checkpointed_layers(s.layers, False, 2) == 0
    assert checkpointed_layers(28, True, 3) == 10
    full = activation_bytes(s, 8, 261, 0)
    assert full == 34 * bsh * s.layers
    assert activation_bytes(s, 8, 261, s.layers) == 2 * bsh * s.layers + 34 * bsh   # the estimate as before
    half = activation_bytes(s, 8, 261, checkpointed_layers(s.layers, True, 2))
    assert activation_bytes(s, 8, 261, s.layers) < half < full
    b = estimate(1.5e9, micro_batch=8, seq_len=261, checkpoint_every=2)
    assert b.inputs["checkpoint_every"] == 2
    with pytest.raises(ValueError):
        estimate(1.5e9, checkpoint_every=0)


def test_room_while_training_names_the_fewest_checkpointed_layers_that_fit():
    roomy = estimate(1.5e9, micro_batch=8, seq_len=261)
    assert any("--gradient-checkpointing false checkpoints 0 of 28" in a for a in roomy.advice)
    # a long sequence on a small GPU: no checkpointing would not fit, every fourth layer would
    tight = estimate(1.5e9, micro_batch=1, seq_len=8192, gpu_gib=32)
    hints = [a for a in tight.advice if "recompute fewer layers" in a]
    assert tight.train_fits and len(hints) == 1 and "--checkpoint-every 4 checkpoints 7 of 28" in hints[0]
    assert not any("recompute fewer" in a for a in estimate(1.5e9, grad_ckpt=False).advice)


def test_a_token_budget_sizes_the_activations_by_its_tokens(capsys):
    rows = _items(estimate(1.5e9, micro_batch=16, seq_len=1024).train)
    tokens = _items(estimate(1.5e9, micro_batch=64, seq_len=1024, micro_batch_tokens=16384).train)
    # 16384 tokens a micro-batch are 16 rows of 1024, whatever --micro-batch says
    assert tokens["activations"] == rows["activations"] > 0 and tokens["logits"] == rows["logits"]
    # a row longer than the budget goes alone: the micro-batch is that row
    long = _items(estimate(1.5e9, seq_len=32768, micro_batch_tokens=4096).train)
    assert long["activations"] == _items(estimate(1.5e9, micro_batch=1, seq_len=32768).train)["activations"]
    tight = estimate(7e9, gpu_gib=40, micro_batch_tokens=65536, seq_len=1024)
    assert not tight.train_fits and any("lower --micro-batch-tokens" in a for a in tight.advice)
    with pytest.raises(ValueError):
        estimate(1.5e9, micro_batch_tokens=0)
    main(["--params", "1.5e9", "--micro-batch-tokens", "4096", "--seq-len", "512"])
    assert "micro-batches of at most 4096 tokens" in capsys.readouterr().out

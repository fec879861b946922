"""VLLMRollout on real vLLM 0.24 (GPU host): the sync reaches the model, sleep frees the GPU, cycles do not grow,
the guards refuse stale or discarded weights, and LoRA adapter updates stay correct across a level-2 sleep.

One engine serves the whole module (an engine is slow to start); the LoRA tests start a second one with
enable_lora at the end. The model is a tiny random Qwen2 built here with a BPE tokenizer trained here.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")   # the kit ships no flashinfer
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from colomem.errors import StaleWeightsError, WeightCheckError  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]
MiB = 1 << 20
GPU_UTIL = 0.25
NEW_TOKENS = 12


# ------------------------------------------------------------------------------------------- the model
def build_tiny(d):
    """A byte-level BPE tokenizer trained on generated text and a random Qwen2 (hidden 256, 4 layers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    rng = random.Random(0)
    syll = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qu", "ba", "do"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) + "." for _ in range(3000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=1500, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(d)
    vocab = (len(fast) + 63) // 64 * 64          # vLLM pads the vocabulary to 64: keep the shapes equal
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False,
                      eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    cfg.architectures = ["Qwen2ForCausalLM"]
    new_model(cfg, seed=0, device="cpu").save_pretrained(d, safe_serialization=True)
    return cfg, len(fast)


def new_model(cfg, seed, device="cuda"):
    """Random weights; a wide lm_head makes greedy choices far apart (few near-ties for bf16 noise)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        m.lm_head.weight.normal_(0.0, 0.5)
    return m.to(torch.bfloat16).eval()


def named(model):
    return [(n, p.detach()) for n, p in model.named_parameters()]


@torch.no_grad()
def hf_logits(model, ids):
    return model(torch.tensor([ids], device="cuda")).logits[0].float()


@torch.no_grad()
def hf_greedy(model, prompt, n, penalty=1.0):
    """Greedy tokens; penalty: the repetition penalty over the prompt's and the completion's tokens so far."""
    ids = list(prompt)
    for _ in range(n):
        row = hf_logits(model, ids)[-1]
        if penalty != 1.0:
            seen = torch.tensor(sorted(set(ids)), device=row.device)
            row[seen] = torch.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
        ids.append(int(row.argmax()))
    return ids[len(prompt):]


def assert_greedy_matches(model, prompts, completions):
    """vLLM's greedy tokens equal transformers' greedy tokens; a sequence may part only at a near-tie.

    Where the two first differ, transformers (teacher-forced on the common prefix) must rate vLLM's token
    within 5% of a logit standard deviation of its own choice: bf16 kernels round differently, garbage
    weights miss by many deviations. vLLM's sampled logprobs must match transformers' on the common prefix.
    """
    matched = total = 0
    for prompt, comp in zip(prompts, completions):
        got = comp.token_ids
        want = hf_greedy(model, prompt, len(got))
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
        logits = hf_logits(model, list(prompt) + got)[len(prompt) - 1:-1]        # predicts got[i] at row i
        if k < len(got):
            row = logits[k]
            gap = float(row[want[k]] - row[got[k]])
            assert gap <= 0.05 * float(row.std()), (
                f"vLLM chose token {got[k]} at step {k} where transformers chose {want[k]} by a margin of {gap:.3f}"
                f" logits (std {float(row.std()):.2f}): the weights in vLLM are not the trainer's")
        lp_hf = torch.log_softmax(logits[:k], dim=-1).gather(1, torch.tensor(got[:k], device="cuda")[:, None])[:, 0]
        if k:
            diff = (lp_hf.cpu() - torch.tensor(comp.logprobs[:k])).abs().max()
            assert diff < 0.25, f"vLLM logprobs differ from transformers' by {float(diff):.3f}"
        matched += k
        total += len(got)
    assert matched >= total // 2, f"only {matched} of {total} greedy tokens agreed before a near-tie"


def greedy(rollout, prompts):
    return [c[0] for c in rollout.generate(prompts, n=1, max_new_tokens=NEW_TOKENS, temperature=0.0, seed=0,
                                           ignore_eos=True)]


def driver_free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def cycle(rollout, weights, version, restore=None):
    rollout.sleep()
    rollout.wake_weights(restore=restore)
    stats = rollout.load_weights(weights, version=version)
    rollout.check()
    rollout.wake_kv()
    return stats


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen2")
    cfg, ntok = build_tiny(d)
    rng = random.Random(1)
    prompts = [[rng.randrange(10, ntok) for _ in range(rng.randint(4, 12))] for _ in range(6)]
    return str(d), cfg, prompts


@pytest.fixture(scope="module")
def rollout(tiny):
    from colomem.engines.vllm import VLLMRollout

    d, _, _ = tiny
    free0 = driver_free()
    r = VLLMRollout(d, gpu_memory_utilization=GPU_UTIL, max_model_len=256, max_num_seqs=16, seed=0,
                    sleep_level=1, weights_backup="vllm", bucket_bytes=256 << 10)   # the embeddings (480 KiB) split
    r.vllm_bytes = free0 - driver_free()          # what vLLM took, before this process allocates more
    assert r.vllm_bytes > 1000 * MiB
    yield r
    r.close()


@pytest.fixture
def r(rollout):
    """The module's engine, awake, with the default sleep mode (a failed test may have left it otherwise)."""
    if rollout.phase == "asleep":
        rollout.wake()
    elif rollout.phase == "weights":
        rollout.wake_kv()
    rollout.sleep_level, rollout.weights_backup = 1, "vllm"
    yield rollout
    rollout.sleep_level, rollout.weights_backup = 1, "vllm"


# ---------------------------------------------------------------------------------------------- tests
def test_greedy_after_a_sync_equals_transformers_with_the_new_weights(r, tiny):
    _, cfg, prompts = tiny
    before = [c.token_ids for c in greedy(r, prompts)]
    model = new_model(cfg, seed=1)
    stats = cycle(r, named(model), version=r.weight_version + 1)
    assert stats.complete is True and stats.nbuckets > 1 and stats.ntensors == len(named(model))
    out = greedy(r, prompts)
    assert_greedy_matches(model, prompts, out)
    assert [c.token_ids for c in out] != before, "the sync changed nothing in vLLM"
    assert all(lp <= 0.0 for c in out for lp in c.logprobs)


def test_top_k_one_and_a_min_p_near_one_sample_the_greedy_tokens(r, tiny):
    _, _, prompts = tiny
    want = [c.token_ids for c in greedy(r, prompts)]
    for knobs in ({"top_k": 1}, {"min_p": 0.999}):
        out = r.generate(prompts, n=2, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=3, ignore_eos=True, **knobs)
        same = sum(c.token_ids == w for g, w in zip(out, want) for c in g)
        # unfiltered, a sample at temperature 1 almost never repeats the greedy tokens; a bf16 tie may split one
        assert same >= 0.75 * 2 * len(want), (knobs, same, len(want))


def test_a_repetition_penalty_decodes_as_transformers_penalized_greedy(r, tiny):
    _, cfg, prompts = tiny
    model = new_model(cfg, seed=2)
    cycle(r, named(model), version=r.weight_version + 1)
    plain = greedy(r, prompts)
    out = [c[0] for c in r.generate(prompts, n=1, max_new_tokens=NEW_TOKENS, temperature=0.0, seed=0,
                                    ignore_eos=True, repetition_penalty=3.0)]
    want = [hf_greedy(model, p, NEW_TOKENS, penalty=3.0) for p in prompts]
    # a bf16 near-tie may part one sequence from transformers'; the penalty must change some
    assert sum(c.token_ids == w for c, w in zip(out, want)) >= 0.75 * len(prompts)
    assert any(c.token_ids != p.token_ids for c, p in zip(out, plain)), "the penalty changed no token"


@pytest.mark.parametrize("backup", ["vllm", "pool"])
def test_sleep_frees_at_least_90_percent_of_vllms_memory(r, backup):
    r.weights_backup = backup
    awake = driver_free()
    r.sleep()
    freed = driver_free() - awake
    r.wake()
    assert freed >= 0.9 * r.vllm_bytes, \
        f"sleep freed {freed / MiB:.0f} MiB of the {r.vllm_bytes / MiB:.0f} MiB vLLM took"
    r.check()


def test_pool_backup_keeps_weights_across_a_level2_sleep(r, tiny):
    _, _, prompts = tiny
    before = [c.token_ids for c in greedy(r, prompts)]
    r.weights_backup = "pool"
    for _ in range(2):
        r.sleep()
        r.wake_weights()
        r.check()
        r.wake_kv()
        assert [c.token_ids for c in greedy(r, prompts)] == before
    mem = r.memory()["workers"][0]
    assert mem["pool"]["pinned"] and mem["pool"]["in_use_bytes"] >= mem["cumem_bytes_by_tag"]["weights"]


def test_level2_sleep_without_backup_refuses_until_every_weight_is_synced(r, tiny):
    _, cfg, prompts = tiny
    model = new_model(cfg, seed=2)
    r.sleep_level = 2
    r.sleep()
    r.wake_weights()
    with pytest.raises(WeightCheckError, match="discarded"):
        r.check()
    with pytest.raises(WeightCheckError, match="missing"):
        r.load_weights(named(model)[:5], version=r.weight_version + 1)
    r.wake_kv()
    with pytest.raises(StaleWeightsError, match="level-2"):
        greedy(r, prompts)
    r.load_weights(named(model), version=r.weight_version + 1)
    r.check()
    assert_greedy_matches(model, prompts, greedy(r, prompts))


def test_stale_weights_are_refused(r, tiny):
    _, cfg, prompts = tiny
    v = r.weight_version + 1
    r.expect_version(v)
    with pytest.raises(StaleWeightsError, match=f"version {v}"):
        greedy(r, prompts)
    model = new_model(cfg, seed=3)
    cycle(r, named(model), version=v)
    assert_greedy_matches(model, prompts, greedy(r, prompts))


def test_twenty_cycles_do_not_grow_memory(r, tiny):
    _, cfg, prompts = tiny
    model = new_model(cfg, seed=4)
    asleep, awake, pool_reserved = [], [], []
    for i in range(20):
        r.weights_backup = "pool" if i % 2 else "vllm"
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=1e-3)     # the "trainer" moved
        r.sleep()
        asleep.append(driver_free())
        r.wake_weights(restore=False if i % 2 else None)
        r.load_weights(named(model), version=r.weight_version + 1)
        r.check()
        r.wake_kv()
        greedy(r, prompts[:2])
        awake.append(driver_free())
        pool = r.memory()["workers"][0]["pool"]
        if pool:
            pool_reserved.append(pool["reserved_bytes"])
    for name, series in (("asleep", asleep), ("awake", awake)):
        drop = max(series[2:5]) - min(series[-3:])
        assert drop <= 64 * MiB, f"free GPU memory while {name} fell by {drop / MiB:.0f} MiB over 20 cycles"
    assert len(set(pool_reserved)) == 1, f"the pinned pool grew: {pool_reserved}"
    assert_greedy_matches(model, prompts, greedy(r, prompts))


# ----------------------------------------------------------------------------------------------- LoRA
@pytest.fixture(scope="module")
def lora_rollout(tiny, rollout):
    from colomem.engines.vllm import VLLMRollout
    from colomem.grpo.config import LoraSpec

    if rollout.phase != "asleep":
        rollout.sleep()                           # the first engine stays, asleep, out of the way
    d, _, _ = tiny
    spec = LoraSpec(r=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    r = VLLMRollout(d, gpu_memory_utilization=GPU_UTIL, max_model_len=256, max_num_seqs=16, seed=0,
                    lora=spec, lora_mode="adapter", sleep_level=2, weights_backup="pool")
    yield r, spec
    r.close()


def peft_model(d, spec, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    base = Qwen2ForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda()
    m = get_peft_model(base, LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=0.0,
                                        target_modules=list(spec.target_modules), task_type="CAUSAL_LM"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.05)
    return m.eval()


def adapter_tensors(m):
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(m).items())


def test_lora_adapter_updates_match_peft_and_survive_a_level2_sleep(lora_rollout, tiny):
    r, spec = lora_rollout
    d, _, prompts = tiny
    base_out = [c.token_ids for c in greedy(r, prompts)]
    m1 = peft_model(d, spec, seed=1)
    r.sleep()
    r.wake_weights()                               # base weights back from the pool (level 2 dropped them)
    st = r.load_weights(adapter_tensors(m1), version=1)
    assert st.adapter_tensors == 4 * 4 * 2 and st.ntensors == 0
    r.check()
    r.wake_kv()
    out1 = greedy(r, prompts)
    assert_greedy_matches(m1, prompts, out1)
    assert [c.token_ids for c in out1] != base_out, "the adapter changed nothing"
    for _ in range(2):                             # sleep/wake with no new adapter: same base, same adapter
        r.sleep()
        r.wake()
        r.check()
        assert [c.token_ids for c in greedy(r, prompts)] == [c.token_ids for c in out1]
    m2 = peft_model(d, spec, seed=2)
    cycle(r, adapter_tensors(m2), version=2)
    assert_greedy_matches(m2, prompts, greedy(r, prompts))


def test_in_process_engine_direct_sync_matches_transformers(r, tiny):
    """engine_in_process=True + sync_transport='direct': vLLM's worker in this process copies the trainer's
    own tensors into its parameters (no bucket). Level-2 sleeps: every version must write every weight."""
    from colomem.engines.vllm import VLLMRollout

    d, cfg, prompts = tiny
    r.sleep()                                   # the module's engine lends its memory meanwhile
    e = VLLMRollout(d, gpu_memory_utilization=GPU_UTIL, max_model_len=256, max_num_seqs=16, seed=0,
                    sleep_level=2, engine_in_process=True, sync_transport="direct")
    try:
        for seed in (5, 6, 7):                  # recorded, then replayed from the trainer's memory
            model = new_model(cfg, seed=seed)
            stats = cycle(e, named(model), version=e.weight_version + 1)
            assert stats.complete is True and stats.nbuckets == 0
            assert_greedy_matches(model, prompts, greedy(e, prompts))
        assert stats.replayed_tensors == stats.ntensors and e._bridge is None
    finally:
        e.close()
    import vllm.envs as vllm_envs                # a later engine of this process is not built in-process
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0" and vllm_envs.VLLM_ENABLE_V1_MULTIPROCESSING


def test_listener_transport_syncs_the_same_weights(r, tiny):
    """sync_transport='listener' (the default): a thread in vLLM's worker takes the versions from the socket,
    no RPC."""
    _, cfg, prompts = tiny
    assert r.sync_transport == "listener"
    try:
        r.set_bucket_bytes(256 << 10)            # re-attach: the listener starts with the new bridge
        for seed in (2, 3, 4):                   # recorded, replayed, then applied as raw ranges
            model = new_model(cfg, seed=seed)
            stats = cycle(r, named(model), version=r.weight_version + 1)
            assert stats.complete is True and stats.nbuckets > 1
            assert_greedy_matches(model, prompts, greedy(r, prompts))
        assert stats.replayed_tensors == stats.ntensors
    finally:
        r.set_bucket_bytes(256 << 10)            # the listener stops with the old bridge


def test_a_sync_into_an_awake_engine_after_retiring_its_prefix_cache_reuses_no_old_block(r, tiny):
    """No sleep between rollouts (the planner's nothing-moves placement): the prefix cache drops in the
    background after the rollout, the sync collects it, and the same prompts then generate with the new
    weights only (a KV block of the old ones would make greedy differ from transformers)."""
    _, cfg, prompts = tiny
    greedy(r, prompts)                           # fills the prefix cache with these prompts' blocks
    for seed in (5, 6):
        r.retire_prefix_cache()
        model = new_model(cfg, seed=seed)
        stats = r.load_weights(named(model), version=r.weight_version + 1)
        r.check()
        assert stats.prefix_reset_early and stats.complete is True
        assert_greedy_matches(model, prompts, greedy(r, prompts))

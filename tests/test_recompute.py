"""Gradient checkpointing on every K-th decoder layer (colomem.engines.recompute), on a small Qwen2 built from
a config: exactly the chosen layers run their forward again in the backward, the gradients are those of no
checkpointing at all, a model without per-layer switches refuses K > 1, and the run config passes K to the
trainers (and refuses it without checkpointing)."""
import pytest
import torch

from colomem.engines.recompute import (checkpointed_layers, disable_recompute, enable_recompute,
                                       keep_checkpointing_every)
from colomem.errors import ConfigError, InvalidArgumentError


def small_qwen2(layers=5):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      use_sliding_window=False)
    model = Qwen2ForCausalLM(cfg)
    model.config.use_cache = False
    return model.train()


def forward_counts_and_grads(model, every):
    if every:
        enable_recompute(model, every)
    else:
        disable_recompute(model)
    counts = [0] * len(model.model.layers)

    def counted(i, forward):  # module hooks do not run in a recompute: the forward itself is counted
        def run(*args, **kwargs):
            counts[i] += 1
            return forward(*args, **kwargs)
        return run

    for i, layer in enumerate(model.model.layers):
        layer.mlp.forward = counted(i, type(layer.mlp).forward.__get__(layer.mlp))
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    for layer in model.model.layers:
        del layer.mlp.forward
    return counts, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("every, recomputed", [(1, [0, 1, 2, 3, 4]), (2, [0, 2, 4]), (3, [0, 3]), (9, [0])])
def test_exactly_every_kth_layer_runs_again_and_the_gradients_are_unchanged(every, recomputed):
    model = small_qwen2()
    counts0, grads0 = forward_counts_and_grads(model, 0)
    assert counts0 == [1] * 5 and checkpointed_layers(model) == 0
    counts, grads = forward_counts_and_grads(model, every)
    assert checkpointed_layers(model) == len(recomputed)
    assert counts == [2 if i in recomputed else 1 for i in range(5)]
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(grads, grads0))


def test_a_bad_k_and_a_model_without_per_layer_switches_are_refused():
    with pytest.raises(InvalidArgumentError):
        enable_recompute(small_qwen2(), 0)

    class Plain(torch.nn.Module):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.on = True

    plain = Plain()
    assert enable_recompute(plain, 1) == -1 and plain.on
    with pytest.raises(InvalidArgumentError, match="checkpoint_every 1"):
        enable_recompute(plain, 2)


def test_the_run_config_passes_k_to_the_trainer_and_refuses_it_without_checkpointing():
    from colomem.runner.config import load_run_config

    cfg = load_run_config(["--gradient-checkpointing", "true", "--checkpoint-every", "3"])
    assert cfg.checkpoint_every == 3 and cfg.deepspeed_config(1).checkpoint_every == 3
    with pytest.raises(ConfigError, match="--gradient-checkpointing true"):
        load_run_config(["--checkpoint-every", "2"])
    with pytest.raises(ConfigError):
        load_run_config(["--gradient-checkpointing", "true", "--checkpoint-every", "0"])


def test_a_model_another_trainer_enables_keeps_every_kth_layer_through_each_enable():
    model = small_qwen2()

    keep_checkpointing_every(model, 2)
    assert checkpointed_layers(model) == 0            # off until someone turns it on
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:                           # the trainer's own call, as transformers' Trainer makes it
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed_layers(model) == 3
    model.gradient_checkpointing_disable()           # a generation turns it off and on again
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed_layers(model) == 3
    keep_checkpointing_every(model, 2)               # idempotent
    assert checkpointed_layers(model) == 3


def test_the_probe_measures_what_a_layer_keeps_per_row_and_leaves_the_checkpointing_as_it_was():
    from colomem.engines.recompute import saved_bytes_per_layer

    model = small_qwen2(layers=6)
    ids = torch.zeros(1, 40, dtype=torch.long)
    assert saved_bytes_per_layer(model, ids) is None          # checkpointing never enabled: nothing to compare
    enable_recompute(model, 2)
    model.eval()
    one, two = saved_bytes_per_layer(model, ids), saved_bytes_per_layer(model, torch.zeros(2, 40, dtype=torch.long))
    assert checkpointed_layers(model) == 3 and not model.training     # as it was
    # a layer keeps at least its hidden states and its MLP's activations (fp32 here), linear in the rows
    assert one >= 40 * 4 * (32 + 64) and two == pytest.approx(2 * one, rel=0.05)

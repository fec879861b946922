"""GRPOBatch layout: right padding, masks that exclude prompt and padding, truncation, aligned logprobs."""
import pytest
import torch

from colomem.errors import InvalidArgumentError
from colomem.grpo.batch import Completion, GRPOBatch, build_batch

PAD = 0


def _batch(**kw):
    prompts = [[11, 12, 13], [21]]
    groups = [[Completion([5, 6, 1], [-0.1, -0.2, -0.3], "stop"), Completion([7, 8], [-0.4, -0.5], "length")],
              [Completion([9], [-0.6], "stop"), Completion([], [], "length")]]
    return build_batch(prompts, groups, [1.0, -1.0, 0.5, -0.5], pad_id=PAD, **kw)


def test_rows_are_prompt_then_completion_right_padded():
    b = _batch()
    assert b.input_ids.tolist() == [[11, 12, 13, 5, 6, 1],
                                    [11, 12, 13, 7, 8, PAD],
                                    [21, 9, PAD, PAD, PAD, PAD],
                                    [21, PAD, PAD, PAD, PAD, PAD]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0],
                                         [1, 0, 0, 0, 0, 0]]


def test_completion_mask_excludes_prompt_and_padding():
    b = _batch()
    assert b.completion_mask.tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 0], [0, 1, 0, 0, 0, 0],
                                          [0, 0, 0, 0, 0, 0]]
    # the mask is a subset of the attention mask and never covers a prompt position
    assert bool(((b.completion_mask > 0) <= (b.attention_mask > 0)).all())


def test_truncated_completion_keeps_its_tokens_and_gets_no_eos():
    b = _batch()
    row = b.input_ids[1].tolist()
    assert row[3:5] == [7, 8] and 1 not in row          # 1 is the EOS of row 0; nothing appended
    assert b.completion_mask[1].sum() == 2


def test_mask_truncated_drops_cut_rows_from_the_loss():
    b = _batch(mask_truncated=True)
    assert b.completion_mask[1].sum() == 0 and b.completion_mask[0].sum() == 3
    assert b.advantages.tolist() == [1.0, -1.0, 0.5, -0.5]   # advantages stay as computed


def test_old_logprobs_aligned_with_input_ids():
    b = _batch()
    assert b.old_logprobs[0].tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, -0.3])
    assert b.old_logprobs[1].tolist() == pytest.approx([0, 0, 0, -0.4, -0.5, 0])
    assert b.old_logprobs[2].tolist() == pytest.approx([0, -0.6, 0, 0, 0, 0])


def test_missing_logprobs_leave_old_logprobs_none():
    b = build_batch([[1, 2]], [[Completion([3], None, "stop"), Completion([4], [-1.0], "stop")]], [1.0, -1.0],
                    pad_id=PAD)
    assert b.old_logprobs is None


def test_select_keeps_rows_and_trims_padding():
    b = _batch()
    s = b.select([2, 3])
    assert s.input_ids.tolist() == [[21, 9], [21, PAD]]
    assert s.advantages.tolist() == [0.5, -0.5]
    assert s.completion_mask.tolist() == [[0, 1], [0, 0]]


def test_to_keeps_values():
    b = _batch()
    c = b.to("cpu")
    assert torch.equal(c.input_ids, b.input_ids) and torch.equal(c.old_logprobs, b.old_logprobs)


def test_bad_inputs_are_refused():
    with pytest.raises(InvalidArgumentError, match="advantages"):
        build_batch([[1]], [[Completion([2], None, "stop")]], [1.0, 2.0], pad_id=0)
    with pytest.raises(InvalidArgumentError, match="empty"):
        build_batch([[]], [[Completion([2], None, "stop")]], [1.0], pad_id=0)
    with pytest.raises(InvalidArgumentError, match="completion groups"):
        build_batch([[1], [2]], [[Completion([2], None, "stop")]], [1.0], pad_id=0)
    with pytest.raises(InvalidArgumentError, match="finish"):
        Completion([1], None, "eos")
    with pytest.raises(InvalidArgumentError, match="logprobs"):
        Completion([1, 2], [-1.0], "stop")
    with pytest.raises(InvalidArgumentError, match="shape"):
        GRPOBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.ones(2, 2), torch.zeros(2))


def test_right_padding_is_known_from_build_batch_and_found_by_select():
    from colomem.grpo.batch import is_right_padded

    b = build_batch([[1, 2], [3]], [[Completion([5, 6, 7])], [Completion([8])]], [1.0, -1.0], pad_id=0)
    assert b.right_padded is True and b.select([1]).right_padded is True
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert not is_right_padded(left) and is_right_padded(right)
    ids = torch.ones(2, 4, dtype=torch.long)
    for mask, want in ((left, False), (right, True)):
        hand = GRPOBatch(ids, mask, mask.float(), torch.zeros(2))
        assert hand.right_padded is None and hand.select([0, 1]).right_padded is want


def test_a_right_padded_batch_gets_the_logprobs_the_padding_mask_gives():
    """A causal model's real tokens attend only to real tokens before them: the forward without the mask gives
    the logprobs of the forward with it on every real position, and a left-padded batch keeps its mask."""
    pytest.importorskip("transformers")
    from dataclasses import replace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from colomem.grpo.step import policy_logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    b = build_batch([[1, 2, 3], [4]], [[Completion([5, 6, 7, 8])], [Completion([9, 10])]], [1.0, -1.0], pad_id=0)
    real = b.attention_mask.bool()
    with torch.no_grad():
        fast = policy_logprobs(model, b)
        masked = policy_logprobs(model, replace(b, right_padded=False))
    torch.testing.assert_close(fast[real], masked[real], rtol=0, atol=1e-5)
    # the same rows left-padded: the mask is needed, and select() finds that it is
    left = GRPOBatch(torch.tensor([[1, 2, 3, 5, 6, 7, 8], [0, 0, 0, 0, 4, 9, 10]]),
                     torch.tensor([[1] * 7, [0] * 4 + [1] * 3]), torch.zeros(2, 7), torch.zeros(2))
    sub = left.select([0, 1])
    assert sub.right_padded is False
    with torch.no_grad():
        lp = policy_logprobs(model, sub)
    torch.testing.assert_close(lp[1, 5:], masked[1, 1:3], rtol=0, atol=1e-5)

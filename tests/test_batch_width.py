"""The planner plans for the widest batch the job can train on, not the measured step's width."""
import dataclasses
import json

import pytest

from colomem.grpo.dataset_task import DatasetTask
from colomem.grpo.tasks import make_task
from colomem.runner.batch_width import widened, widest_row
from colomem.runner.placement import ALL_CATEGORIES, choose, micro_batch_fit
from fakes.placement import GB, figs


def test_the_widest_row_is_the_longest_prompt_plus_the_completions_most_within_the_model_length(tmp_path):
    task = make_task("successor", {"prompt_len": 5})
    assert task.longest_prompt_tokens == 6                       # the separator and five symbols
    assert widest_row(512, task, 256) == 262
    assert widest_row(200, task, 256) == 200                     # vLLM never goes past the model length
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in ("ab", "abcdefgh", "abcd")))
    ds = DatasetTask(str(path), max_new_tokens=16)
    assert widest_row(512, ds, 16) == 512                        # prompts not tokenized yet: the model length

    class Chars:                                                 # one token a character
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(len(text)))}
    ds.bind(Chars(), chat_template="none", max_prompt_tokens=6, log=lambda *_: None)
    assert ds.dropped == 1 and ds.longest_prompt_tokens == 4     # the 8-token prompt was left out
    assert widest_row(512, ds, 16) == 20


def test_widened_figures_count_the_activations_at_the_widest_row_and_nothing_else():
    f = dataclasses.replace(figs(peak=53), pre_step_peak=50 * GB)   # 45 GB of state: 8 GB of activations
    state = f.kept_bytes(ALL_CATEGORIES)
    wide = widened(f, 260, 520)
    assert wide.train_peak - state == 2 * (f.train_peak - state)
    assert wide.pre_step_peak - state == 2 * (f.pre_step_peak - state)
    assert (wide.state, wide.rollout_used, wide.trainer_left, wide.total) == (f.state, f.rollout_used,
                                                                                f.trainer_left, f.total)
    assert widened(f, 520, 520) is f and widened(f, 600, 520) is f and widened(f, 0, 520) is f
    # what the plan then holds: half the rows the measured width would have grown to
    p = choose("auto", "auto", [f], margin=2 * GB)
    assert micro_batch_fit(p, [f], 4, 64, margin=2 * GB) == 16
    assert micro_batch_fit(p, [wide], 4, 64, margin=2 * GB) == 8


@pytest.mark.parametrize("peak, label", [(53, "nothing moves"), (70, "trainer resident, rollout sleeps")])
def test_a_placement_that_fits_the_measured_step_but_not_the_widest_one_is_not_taken(peak, label):
    """Nothing moving fits the measured step (45 GB of state, 8 GB of activations, 60 GB of vLLM, 140 GB);
    at twice the width it still does. With 25 GB of activations it fits measured, and not at twice the width."""
    f = figs(peak=peak)
    assert choose("auto", "auto", [f], margin=2 * GB).label == "nothing moves"
    assert choose("auto", "auto", [widened(f, 100, 200)], margin=2 * GB).label == label

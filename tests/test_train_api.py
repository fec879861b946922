"""train(...): the job from Python with the model, reward functions and datasets as objects (TRL's way of
passing them); rows given in memory are written once, named by their content."""
import pytest

from colomem.errors import ConfigError
from colomem.runner import train
from colomem.runner.api import build_config, materialize
from colomem.runner.checkpoints import identity
from test_dataset_job import TEMPLATE, successor_rows


def test_a_job_from_rows_and_callables_in_memory_runs_and_evaluates(job_env, tmp_path):
    import datasets

    tpl = tmp_path / "chat.jinja"
    tpl.write_text(TEMPLATE)
    seen = []

    def exact(prompt, completion, *, answer, source, **meta):
        seen.append(source)
        return 1.0 if completion.strip() == answer else 0.0

    def short(prompt, completion, **meta):
        return -0.1 * len(completion)

    res = train(reward_funcs=[exact, short], train_dataset=successor_rows(24),
                eval_dataset=datasets.Dataset.from_list(successor_rows(6, seed=1)), reward_weights=[1.0, 0.5],
                backend="cpu", steps=2, prompts_per_step=4, micro_batch=8, group_size=4, max_new_tokens=3,
                chat_template=str(tpl), eval_every=1, progress=False, report_to=["none"], out=str(tmp_path / "run"),
                print_fn=lambda *_: None)
    s = res.summary
    assert s["status"] == "ok" and s["steps_done"] == 2
    # the other columns reach the rewards: 2 steps x 4 prompts x 4 completions, and 3 evaluations of 6 prompts
    assert len(seen) == 2 * 4 * 4 + 3 * 6 and set(seen) == {"synthetic"}
    cfg = s["config"]
    assert cfg["rewards"] == ["test_train_api:test_a_job_from_rows_and_callables_in_memory_runs_and_evaluates"
                              ".<locals>.exact", "test_train_api:test_a_job_from_rows_and_callables_in_memory_runs"
                              "_and_evaluates.<locals>.short"]
    assert cfg["dataset"].endswith(".parquet") and "/datasets/train-" in cfg["dataset"]
    assert s.get("eval_first") is not None and s.get("eval_last") is not None


def test_rows_are_named_by_their_content_whatever_built_them(tmp_path):
    import datasets

    rows = successor_rows(8)
    a = materialize(rows, "train", root=tmp_path)
    assert materialize(datasets.Dataset.from_list(rows), "train", root=tmp_path) == a
    assert materialize({k: [r[k] for r in rows] for k in rows[0]}, "train", root=tmp_path) == a
    other = materialize(successor_rows(8, seed=3), "train", root=tmp_path)
    assert other != a
    back = datasets.load_dataset("parquet", data_files=a, split="train")
    assert [dict(r) for r in back] == rows                                  # the rows, byte for byte as given
    assert materialize("some/file.jsonl", "train") == "some/file.jsonl"    # a path is read as --dataset reads it
    # a checkpoint of one run is refused by a run on other rows (its identity names the file)
    same = build_config(train_dataset=rows, reward_funcs="exact_match", max_new_tokens=3, data_root=tmp_path)[0]
    changed = build_config(train_dataset=successor_rows(8, seed=3), reward_funcs="exact_match", max_new_tokens=3,
                           data_root=tmp_path)[0]
    assert identity(same)["data"] == a and identity(changed)["data"] != identity(same)["data"]


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new_token": 3}, "did you mean max_new_tokens"),
    ({"lora": False, "lora_r": 8}, "lora=False together with lora_r"),
    ({"train_dataset": []}, "non-empty list of dicts"),
    ({"train_dataset": 42}, "got int"),
    ({"reward_funcs": [3]}, "reward_funcs must be"),
    ({"clip_eps": -1.0}, "clip_eps"),
])
def test_bad_arguments_are_config_errors_naming_them(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        build_config(data_root=tmp_path, **kwargs)


def test_a_split_dataset_or_a_stream_is_refused_with_what_to_pass(tmp_path):
    import datasets

    rows = datasets.Dataset.from_list(successor_rows(4))
    with pytest.raises(ConfigError, match="pass one split"):
        materialize(datasets.DatasetDict({"train": rows}), "train", root=tmp_path)
    with pytest.raises(ConfigError, match="streaming"):
        materialize(rows.to_iterable_dataset(), "train", root=tmp_path)


def test_keywords_land_where_their_flags_do(tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):    # looked for, not read, here
        (tmp_path / name).write_text("{}")
    cfg, fns = build_config(tmp_path, reward_funcs=len, lora_r=8, temperature=0.7, offload="none",
                            steps=3, data_root=tmp_path)
    assert cfg.model == str(tmp_path) and cfg.lora is not None and cfg.lora.r == 8
    assert cfg.grpo.temperature == 0.7 and cfg.offload == "none" and cfg.steps == 3 and fns == [len]
    assert build_config(lora=True, data_root=tmp_path)[0].lora is not None


def test_ranks_writing_the_same_rows_at_once_agree_on_one_whole_file(tmp_path):
    """Every rank of a torchrun job calls train() with the same rows: each writes its own temporary file and
    renames it into place, so all read one whole file and no temporary one is left."""
    import datasets
    from concurrent.futures import ThreadPoolExecutor

    rows = successor_rows(64)
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: materialize(rows, "train", root=tmp_path), range(8)))
    assert len(set(paths)) == 1 and [p.name for p in tmp_path.iterdir()] == [paths[0].rsplit("/", 1)[1]]
    assert [dict(r) for r in datasets.load_dataset("parquet", data_files=paths[0], split="train")] == rows

"""The trained model at the end of a run (<out>/model): written when no checkpoint holds it, linked from the
last step's checkpoint when one does, loadable by transformers with the run's final weights; none with
--no-save-final; a failed write is a CheckpointError that leaves the checkpoints alone."""
import os

import pytest
import torch

from colomem.runner import run_job
from colomem.runner.checkpoints import CheckpointError
from colomem.runner.final_model import save_final_model
from test_checkpoints import cfg, final_weights

quiet = dict(print_fn=lambda *_: None)


def test_the_final_model_is_the_runs_last_weights_written_or_linked(job_env, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = run_job(cfg(tmp_path / "saved", steps=3, save_every=3), **quiet)
    plain = run_job(cfg(tmp_path / "plain", steps=3), **quiet)
    assert saved.summary["final_model"] == str(tmp_path / "saved" / "model")
    assert plain.summary["final_model"] == str(tmp_path / "plain" / "model")
    assert not (tmp_path / "plain" / "checkpoints").exists() and not (tmp_path / "plain" / ".tmp-model").exists()
    # linked from the checkpoint: the same files, not a second write
    ck = tmp_path / "saved" / "checkpoints" / "step-3" / "model"
    for f in ck.iterdir():
        assert os.path.samefile(f, tmp_path / "saved" / "model" / f.name)
    last = final_weights(tmp_path / "saved", 3)["model"]
    for out in (tmp_path / "saved", tmp_path / "plain"):          # the same seeded run: the same weights
        model = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
        assert all(torch.equal(p, last[n]) for n, p in model.state_dict().items() if n in last)
        assert AutoTokenizer.from_pretrained(out / "model").eos_token_id is not None


def test_lora_gives_the_adapter_and_the_merged_model_and_the_flag_turns_it_off(job_env, tmp_path):
    lora = run_job(cfg(tmp_path / "lora", steps=2, lora={"r": 4}, save_merged=True), **quiet)
    assert (tmp_path / "lora" / "model" / "adapter_config.json").is_file()
    assert (tmp_path / "lora" / "model-merged" / "config.json").is_file()
    assert (tmp_path / "lora" / "model-merged" / "tokenizer_config.json").is_file()
    assert lora.summary["final_model"] == str(tmp_path / "lora" / "model")
    off = run_job(cfg(tmp_path / "off", steps=2, save_final=False), **quiet)
    assert "final_model" not in off.summary and not (tmp_path / "off" / "model").exists()


class _FullDisk:
    """A trainer whose model write fails as a full disk does."""
    def prepare_save(self, path, *, merged=False, state=True):
        assert state is False                       # the model alone, no trainer state

        class Write:
            def write(self):
                (path / "model").mkdir(parents=True)
                raise OSError(28, "No space left on device", str(path / "model" / "model.safetensors"))
        return Write()


def test_a_failed_write_is_a_checkpoint_error_and_leaves_no_partial_model(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "old.txt").write_text("the model of an earlier run here")
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_final_model(tmp_path, _FullDisk(), tokenizer=None, ranks=None, merged=False, checkpoint=None,
                         say=lambda *_: None)
    assert not (tmp_path / ".tmp-model").exists()
    assert (tmp_path / "model" / "old.txt").is_file()               # nothing replaced by a half model

"""dslurm.integrations' refusals and names, pure (dslurm/integrations/rules.py): the settings an HF
Trainer or a Lightning Trainer cannot run on the chain with, each named with its fix; the library's
folder inside a generation; the world-size refusal; `dslurm ctl` takes requests of an adapted script."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from dslurm import checkpoint as ck
from dslurm.errors import UserError
from dslurm.integrations.rules import (
    hf_problems,
    hf_saves_itself,
    library_folder,
    lightning_problems,
    world_change_error,
)
from dslurm.observe import ctl


def hf_args(**kw: object) -> SimpleNamespace:
    base = {"save_strategy": "no", "eval_strategy": "no", "save_steps": 500, "max_steps": 30,
            "save_only_model": False, "save_on_each_node": False, "load_best_model_at_end": False}
    return SimpleNamespace(**{**base, **kw})


def test_plain_hf_settings_pass():
    assert hf_problems(hf_args(), {}) == []
    assert hf_problems(hf_args(save_strategy="steps", save_steps=10), {}) == []
    assert hf_problems(hf_args(save_strategy=SimpleNamespace(value="epoch")), {}) == []  # the enum's value
    assert hf_problems(hf_args(save_strategy="steps", save_steps=0.1), {}) == []  # a fraction of max_steps


@pytest.mark.parametrize(("kw", "train", "named"), [
    ({"save_strategy": "best"}, {}, "save_strategy='best' with eval_strategy='no' never saves"),
    ({"save_only_model": True}, {}, "save_only_model=True"),
    ({"save_on_each_node": True}, {}, "save_on_each_node=True"),
    ({"load_best_model_at_end": True}, {}, "load_best_model_at_end=True"),
    ({}, {"resume_from_checkpoint": "x"}, "resume_from_checkpoint"),
])
def test_hf_settings_that_cannot_run_are_named_with_their_fix(kw, train, named):
    (problem,) = hf_problems(hf_args(**kw), train)
    assert named in problem and "Fix:" in problem


def test_an_hf_schedule_that_saves_nothing_in_the_run_leaves_it_to_the_job():
    assert not hf_saves_itself(hf_args())  # save_strategy="no"
    assert not hf_saves_itself(hf_args(save_strategy="steps", save_steps=500))  # HF's default, 30 steps
    assert hf_saves_itself(hf_args(save_strategy="steps", save_steps=10))
    assert hf_saves_itself(hf_args(save_strategy="steps", save_steps=0.1))  # a fraction of max_steps
    assert hf_saves_itself(hf_args(save_strategy="epoch"))
    assert hf_saves_itself(hf_args(save_strategy="steps", save_steps=500, max_steps=-1))  # epochs: unknown here


def test_lightning_settings():
    ok = SimpleNamespace(accumulate_grad_batches=1, max_steps=30, max_epochs=None)
    assert lightning_problems(ok, {"train_dataloaders": object()}) == []
    (p,) = lightning_problems(ok, {"ckpt_path": "last"})
    assert "ckpt_path" in p and "Fix: drop ckpt_path" in p
    (p,) = lightning_problems(SimpleNamespace(accumulate_grad_batches=4, max_steps=30, max_epochs=None), {})
    assert "accumulate_grad_batches=4" in p and "Fix:" in p
    (p,) = lightning_problems(SimpleNamespace(accumulate_grad_batches=1, max_steps=-1, max_epochs=-1), {})
    assert "never ends" in p


def test_the_library_folder_is_the_generations_files(tmp_path: Path):
    gen = tmp_path / "step-00000004-20260101T000000Z-abcdef"
    with pytest.raises(UserError, match="holds no transformers checkpoint"):
        library_folder(gen, "transformers")
    (gen / ck.FILES).mkdir(parents=True)
    assert library_folder(gen, "transformers") == gen / ck.FILES


def test_a_world_size_change_is_refused_with_the_saved_size():
    err = world_change_error("lightning", 4, 2, Path("/run/generations/g"), "why")
    assert err.exit_code == 2 and "saved by 4 processes, resumed by 2" in str(err)
    assert "resubmit with 4 processes" in str(err)


def test_ctl_takes_requests_of_a_script_run_through_an_integration(tmp_path: Path):
    (tmp_path / "hf.py").write_text("import dslurm.integrations.hf as dh\ndh.run(trainer)\n")
    (tmp_path / "plain.py").write_text("trainer.train()\n")
    assert ctl.script_refusal(tmp_path, ["hf.py"], [tmp_path]) is None
    assert "never calls" in (ctl.script_refusal(tmp_path, ["plain.py"], [tmp_path]) or "")

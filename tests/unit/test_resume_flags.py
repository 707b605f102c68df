"""What a resume must match (training/checkpoints.py ``RESUME_MUST_MATCH``, the one list, read by
``resume_mismatches``): the tests are generated from the list, so a setting added to it is
tested. Each flag changed on a resume is refused with a message naming the flag, the recorded
and the given value; ``--finetune`` (a new run from the weights) warns about what it may change
and skips the optimizer's entries, as ``--no-load-optim`` does. A LoRA run resumed with another
``--lora-dropout`` was accepted silently and rewrote the recorded value."""
from __future__ import annotations

import copy

import pytest

from core.checkpoint.sharded import _short
from models.step37 import Step37Config
from train_args import parse
from training.checkpoints import RESUME_MUST_MATCH, CheckpointError, resume_mismatches, run_flags_record


def _meta(*flags) -> dict:
    """A run's record as the trainer writes it (``Trainer._meta``), less what no entry reads."""
    args = parse(["--data-path", "unused", "--model-preset", "step37-tiny-vlm", *flags])
    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["attention"],
            "base": {"load_hf": "/base", "seed": None, "config_sha256": "c" * 16, "weights_fingerprint": "a" * 16}}
    return {"family": "step37", "model": Step37Config.preset("step37-tiny-vlm").to_dict(),
            **run_flags_record(args), "lora": lora}


def _other(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1 if v < 1 else v / 2 + 0.25  # a dropout stays below 1
    if isinstance(v, list):
        return v + ["experts"]
    if isinstance(v, dict):  # the model config: one field
        return {**v, "num_layers": v["num_layers"] + 1}
    return v + "x"


def _changed(meta: dict, path: tuple) -> dict:
    out = copy.deepcopy(meta)
    at = out
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = _other(at[path[-1]])
    return out


def _values(saved: dict, run: dict, path: tuple) -> tuple[str, str]:
    a, b = saved, run
    for key in path:
        a, b = a[key], b[key]
    if isinstance(a, dict):
        return f"checkpoint {a['num_layers']}", f"this run {b['num_layers']}"
    return f"checkpoint {_short(a)}", f"this run {_short(b)}"


def test_every_entry_is_recorded():
    """Each path of the list is in what a run records (else it could never be compared)."""
    meta = _meta()
    for m in RESUME_MUST_MATCH:
        at = meta
        for key in m.path:
            assert isinstance(at, dict) and key in at, m
            at = at[key]


IDS = [m.flag for m in RESUME_MUST_MATCH]


@pytest.mark.parametrize("entry", RESUME_MUST_MATCH, ids=IDS)
def test_each_flag_changed_on_resume_is_refused_naming_it_and_both_values(entry):
    saved = _meta()
    run = _changed(saved, entry.path)
    refused, warned = resume_mismatches(saved, run, finetune=False, load_optim=True)
    assert len(refused) == 1 and not warned, (refused, warned)
    recorded, given = _values(saved, run, entry.path)
    assert refused[0].startswith(f"{entry.flag}: ") and f"{recorded}, {given}" in refused[0], refused[0]
    assert resume_mismatches(saved, copy.deepcopy(saved), finetune=False, load_optim=True) == ([], [])


@pytest.mark.parametrize("entry", RESUME_MUST_MATCH, ids=IDS)
def test_finetune_and_a_fresh_optimizer_relax_what_they_start_afresh(entry):
    saved = _meta()
    run = _changed(saved, entry.path)
    tuned = resume_mismatches(saved, run, finetune=True, load_optim=True)
    fresh = resume_mismatches(saved, run, finetune=False, load_optim=False)
    counts = {"always": ((1, 0), (1, 0)), "resume": ((0, 1), (1, 0)), "optimizer": ((0, 0), (0, 0))}[entry.scope]
    assert ((len(tuned[0]), len(tuned[1])), (len(fresh[0]), len(fresh[1]))) == counts


def test_an_entry_absent_on_one_side_is_not_compared():
    """An older checkpoint (no ``freeze`` record) and a run without LoRA compare nothing there."""
    saved, run = _meta(), _meta("--freeze-vision")
    del saved["freeze"]
    run.pop("lora")
    assert resume_mismatches(saved, run, finetune=False, load_optim=True) == ([], [])


def test_the_resume_refuses_in_one_line_naming_the_checkpoint(tmp_path):
    """Through RunCheckpoints.resume: another --lora-dropout is refused before anything loads."""
    from core.checkpoint.sharded import save_checkpoint
    from models.step37 import Step37Model
    from training.checkpoints import RunCheckpoints

    saved = _meta("--optimizer", "adamw")
    save_checkpoint(str(tmp_path / "ck"), 2, [Step37Model(Step37Config.preset("step37-tiny-vlm"))], None, {}, saved)
    args = parse(["--data-path", "unused", "--load", str(tmp_path / "ck")])
    run = _changed(saved, ("lora", "dropout"))
    with pytest.raises(CheckpointError) as e:
        RunCheckpoints(args, None).resume(run, [], None)
    assert str(e.value) == (f"--load {tmp_path / 'ck' / 'iter_0000002'}: saved with other flags than this run's: "
                            "--lora-dropout: checkpoint 0.0, this run 1.0 (resume with the checkpoint's LoRA flags, or "
                            "start a new run from them with --finetune)")

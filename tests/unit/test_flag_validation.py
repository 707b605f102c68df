"""Every numeric flag is checked when the flags are parsed (or, for what needs the model or the
file system, by ``validate``), before any process group exists: the error names the flag.
Before, ``--log-interval 0`` divided by zero after step 1, ``--save-interval -1`` saved every
step, ``--lr nan`` was accepted and an unwritable ``--save`` was found at the first save."""
from __future__ import annotations

import re

import pytest

from train_args import parse, validate

BAD = [
    (["--log-interval", "0"], "--log-interval must be >= 1"),
    (["--save-interval", "-1"], "--save-interval must be >= 0"),
    (["--keep-last", "-2"], "--keep-last must be >= 0"),
    (["--max-skipped-steps", "-1"], "--max-skipped-steps must be >= 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--lr", "inf"], "--lr must be a finite number > 0"),
    (["--min-lr", "nan"], "--min-lr must be a finite number >= 0"),
    (["--adamw-lr", "0"], "--adamw-lr must be a finite number > 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0"),
    (["--clip-grad", "nan"], "--clip-grad must be a finite number >= 0"),
    (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps must be a finite number > 0"),
    (["--muon-ns-steps", "0"], "--muon-ns-steps must be >= 1"),
    (["--dion-rank-fraction", "1.5"], "--dion-rank-fraction must be in (0, 1]"),
    (["--mtp-loss-scale", "nan"], "--mtp-loss-scale must be a finite number >= 0"),
    (["--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff must be a finite number >= 0"),
    (["--train-iters", "0"], "--train-iters must be >= 1"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be >= 1"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters must be >= 0"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in [0, 1]"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "not both"),
    (["--lr-warmup-iters", "20", "--train-iters", "10"], "longer than the schedule"),
    (["--exit-interval", "0"], "--exit-interval must be >= 1"),
    (["--exit-duration-in-mins", "-5"], "--exit-duration-in-mins must be a finite number > 0"),
    (["--eval-interval", "0"], "--eval-interval must be >= 1"),
    (["--eval-iters", "-1"], "--eval-iters must be >= 0"),
    (["--recompute-num-layers", "-1"], "--recompute-num-layers must be >= 0"),
    (["--recompute-num-layers", "2"], "--recompute-num-layers needs --recompute-granularity"),
    (["--recompute-chunks", "0"], "--recompute-chunks must be >= 1"),
    (["--recompute-chunks", "2"], "--recompute-chunks needs --recompute-granularity full"),
    (["--offload-recompute-inputs", "--recompute-granularity", "selective"],
     "--offload-recompute-inputs needs --recompute-granularity full"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be a finite number > 0"),
    (["--seq-length", "0"], "--seq-length must be >= 1"),
    (["--compile", "--attention-backend", "flex"], "--compile does not support --attention-backend flex "),
    (["--vocab-size", "0"], "--vocab-size must be >= 1"),
    (["--vocab-size", "1024", "--load-hf", "x"], "--vocab-size cannot change the vocabulary of --load-hf"),
    (["--profile"], "--profile needs --log-dir: the traces are written under it"),
    (["--profile-step-start", "-1"], "--profile-step-start must be >= 0"),
    (["--profile-step-start", "3", "--profile-step-end", "3"],
     "--profile-step-end 3 must be above --profile-step-start 3"),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_numeric_flag_is_a_usage_error_naming_it(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--data-path", "unused", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--seq-length", "8192"], "--seq-length 8192 exceeds the model's max_position_embeddings 4096"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "9"],
     "--recompute-num-layers 9 exceeds the model's 4 layers"),
    (["--finetune"], "--finetune needs --load"),
    (["--attention-backend", "varlen"], "--attention-backend varlen .* add --bf16"),
    (["--recompute-granularity", "full", "--recompute-chunks", "3", "--micro-batch-size", "2",
      "--global-batch-size", "2"], "--recompute-chunks 3 must divide --micro-batch-size 2"),
    (["--recompute-granularity", "full", "--recompute-chunks", "2", "--micro-batch-size", "2",
      "--global-batch-size", "2", "--compile"], "--compile with --recompute-chunks"),
])
def test_checks_against_the_model(flags, message):
    with pytest.raises(ValueError, match=message):
        validate(parse(["--data-path", "unused", *flags]), world=1, check_files=False)


OVERLAP = ["--overlap-moe-expert-parallel-comm"]
EP2 = [*OVERLAP, "--expert-model-parallel-size", "2"]


@pytest.mark.parametrize("flags,world,message", [
    (OVERLAP, 1, "--overlap-moe-expert-parallel-comm needs --expert-model-parallel-size > 1"),
    ([*EP2, "--moe-dispatcher", "allgather"], 2, "needs --moe-dispatcher alltoall"),
    ([*EP2, "--context-parallel-size", "2"], 2, "with --context-parallel-size > 1 is not supported"),
    ([*EP2, "--recompute-granularity", "selective"], 2, "with --recompute-granularity selective"),
    ([*EP2, "--compile"], 2, "with --compile is not supported"),
])
def test_moe_overlap_refuses_what_it_does_not_serve_by_name(flags, world, message):
    with pytest.raises(ValueError, match=message):
        validate(parse(["--data-path", "unused", *flags]), world=world, check_files=False)
    full = ["--data-path", "unused", *EP2, "--recompute-granularity", "full", "--bf16", "--data-parallel-sharding",
            "fsdp", "--pipeline-model-parallel-size", "2"]
    validate(parse(full), world=4, check_files=False)  # what it serves passes


def test_unwritable_save_is_found_at_start_up(tmp_path, monkeypatch):
    """A --save under a regular file cannot be created, whoever runs it (root included)."""
    from training import run_files

    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(run_files, "check_data_files", lambda args, cfg: None)  # no dataset here
    args = parse(["--data-path", "unused", "--save", str(tmp_path / "file" / "ck")])
    with pytest.raises(ValueError, match=r"--save .*/file/ck: cannot write there"):
        validate(args, world=1)


def test_good_flags_pass():
    args = parse(["--data-path", "unused", "--lr-warmup-fraction", "0.1", "--lr-decay-iters", "50",
                  "--train-iters", "80", "--exit-interval", "10", "--keep-last", "0", "--save-interval", "0"])
    assert args.schedule.warmup_iters == 5 and args.schedule.decay_iters == 50
    assert parse(["--data-path", "unused"]).schedule.decay_iters == 100  # --train-iters


@pytest.mark.parametrize("preset", ["tiny", "qwen3-moe-tiny"])
def test_vocab_size_resizes_any_familys_preset(preset):
    """The quickstart's tiny model with a 1,024-entry tokenizer: only the vocabulary changes."""
    from train_args import model_config

    base = model_config(parse(["--data-path", "unused", "--model-preset", preset]))
    cfg = model_config(parse(["--data-path", "unused", "--model-preset", preset, "--vocab-size", "1024"]))
    assert (base.vocab_size, cfg.vocab_size) == (320, 1024)
    assert {**cfg.to_dict(), "vocab_size": 320} == base.to_dict()


PROFILE = ["--data-path", "unused", "--profile", "--log-dir", "unused", "--train-iters", "10"]


@pytest.mark.parametrize("flags, world, message", [
    # iterations start + 1 .. end are recorded: a start at --train-iters records nothing
    (["--profile-step-start", "10"], 1, "--profile-step-start 10 records nothing: the run ends when "
                                        "--train-iters 10 iterations are done; start below 10"),
    (["--profile-step-start", "50", "--profile-step-end", "60"], 4, "--profile-step-start 50 records nothing"),
    (["--profile-step-start", "2", "--profile-ranks", "0", "4"], 4,
     "--profile-ranks 4: no such rank in a world of 4 (ranks 0 to 3): it would record nothing"),
    (["--profile-step-start", "2", "--profile-ranks", "-1"], 2, "--profile-ranks -1: no such rank"),
])
def test_a_profile_window_that_records_nothing_is_refused_at_start_up(flags, world, message):
    """Before, each of these trained to the end and wrote no trace, saying nothing."""
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        validate(parse([*PROFILE, *flags]), world=world, check_files=False)


def test_profile_step_start_alone_records_the_two_iterations_after_it():
    """--profile-step-start 20 alone was refused, "--profile-step-end 12 must be above
    --profile-step-start 20", for a flag never given (the fixed default end 12). The end now
    defaults to two after the start, and a window inside the run passes."""
    from training.profiling import check_profile

    for start, end in ((5, 7), (10, 12), (8, 10)):
        args = parse([*PROFILE, "--profile-step-start", str(start)] if start != 10 else PROFILE[:-2])
        assert (args.logging.profile_step_start, args.logging.profile_end) == (start, end)
    args = parse([*PROFILE, "--profile-step-start", "20", "--train-iters", "30"])
    assert args.logging.profile_end == 22
    check_profile(args.logging, args.schedule.train_iters, 1)
    check_profile(parse([*PROFILE, "--no-profile", "--profile-step-start", "99"]).logging, 10, 1)  # off: no rule


def test_a_run_resumed_past_the_profile_window_says_it_records_nothing():
    import io
    from types import SimpleNamespace

    from training.profiling import StepProfiler

    log = SimpleNamespace(stream=io.StringIO())
    prof = StepProfiler(parse([*PROFILE, "--profile-step-start", "2"]).logging, rank=0, log=log)
    with prof.step(6):  # resumed with 6 iterations done: the window (3, 4) is behind it
        pass
    with prof.step(7):
        pass
    assert log.stream.getvalue() == ("[rank 0] --profile: nothing recorded: the run starts at iteration 7, "
                                     "after --profile-step-end 4\n")
    assert prof.prof is None

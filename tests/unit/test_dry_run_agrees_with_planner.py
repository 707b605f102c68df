"""``pretrain_step37.py --dry-run N`` and ``tools/plan_memory.py --world-size N`` accept and refuse
the same flag sets with the same message, over every combination below of the flags the planner
books or refuses (freeze flags, LoRA, memory modes) on a text and a vision-language model; what
both accept they plan from the same inputs. Before, ``--dry-run`` planned ``--freeze-projector``
and ``--freeze-language`` (which the planner does not book) as if nothing were frozen, and
``--freeze-vision`` as a trained tower. Both entry points are called in this process, through the
functions their ``main`` calls (no subprocess per combination).

The planner's own inputs (``--image-token-share``, the time model, ``--device-gb``) are not
training flags, so ``--dry-run`` plans their defaults (text only); images on a model without a
vision tower to plan are refused by the planner (last test)."""
from __future__ import annotations

import itertools

import pytest

import pretrain_step37
from tools import plan_memory
from train_args import parse
from training.planner.run import plan_inputs

WORLD = 2
MODELS = (["--model-preset", "tiny"], ["--model-preset", "step37-tiny-vlm"])
FREEZE = [[f"--freeze-{p}" for p in parts] for n in range(4)
          for parts in itertools.combinations(("vision", "projector", "language"), n)]
LORA = ([], ["--lora-rank", "4"], ["--lora-alpha", "8"])  # the last: alpha without a rank, refused
MEMORY = ([],
          ["--data-parallel-sharding", "fsdp", "--cpu-offload", "all"],
          ["--data-parallel-sharding", "fsdp", "--cpu-offload", "optimizer", "--bf16"],
          ["--data-parallel-sharding", "fsdp", "--cpu-offload", "masters", "--bf16", "--global-batch-size", "2"],
          ["--data-parallel-sharding", "fsdp", "--cpu-offload", "masters", "--bf16"],  # 4 micro-batches: refused
          ["--data-parallel-sharding", "fsdp", "--cpu-offload", "masters"],  # without --bf16: refused
          ["--cpu-offload", "experts"])  # without FSDP: refused
COMBOS = ([m + f + lo for m, f, lo in itertools.product(MODELS, FREEZE, LORA)]
          + [MODELS[1] + f + lo + mem for f, lo, mem in itertools.product(FREEZE[:2], LORA, MEMORY[1:])])


def _verdict(entry, argv, capsys):
    """("ok", the plan's inputs) or ("refused", the error message without the program's name)."""
    try:
        args, layout = entry(argv)
    except ValueError as e:
        return "refused", str(e)
    except SystemExit as e:  # a section's usage error: "usage: ...", then "<prog>: error: <message>"
        assert e.code == 2
        return "refused", capsys.readouterr().err.strip().splitlines()[-1].split(": error: ", 1)[1]
    return "ok", plan_inputs(args, layout)


def _dry_run(flags):
    args = parse(["--data-path", "unused", *flags, "--dry-run", str(WORLD)])
    return args, pretrain_step37.checked_layout(args)[1]


def _planner(flags):
    _, args, _, layout = plan_memory.planned(["--world-size", str(WORLD), "--data-path", "unused", *flags])
    return args, layout


def test_dry_run_and_the_planner_give_the_same_verdict_for_every_combination(capsys):
    accepted, messages = 0, set()
    for flags in COMBOS:
        dry, planned = _verdict(_dry_run, flags, capsys), _verdict(_planner, flags, capsys)
        assert dry == planned, flags
        accepted += dry[0] == "ok"
        messages |= {dry[1]} if dry[0] == "refused" else set()
    # both verdicts well represented, and each refusal the planner owns among them
    assert accepted >= 10 and len(COMBOS) - accepted >= 10, accepted
    for part in ("projector", "language"):
        assert f"--freeze-{part} is not planned (the planner books a frozen vision tower only, --freeze-vision); " \
               "plan without it for an upper bound" in messages
    assert "--freeze-vision with --lora-rank: LoRA freezes every base weight already (its adapters are the " \
           "only trained parameters)" in messages


def test_dry_run_plans_a_frozen_tower_frozen():
    """--freeze-vision under --dry-run planned the tower's gradients and optimizer state."""
    flags = [*MODELS[1], "--freeze-vision"]
    assert plan_inputs(*_dry_run(flags)).freeze_vision is True
    assert plan_inputs(*_dry_run(flags)) == plan_inputs(*_planner(flags))


@pytest.mark.parametrize("value", ["0", "-1"])
def test_dry_run_0_is_refused_not_a_training_run(value, capsys):
    """--dry-run 0 was the default's value: it started a full training run."""
    with pytest.raises(SystemExit):
        parse(["--data-path", "unused", "--dry-run", value])
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"pretrain_step37.py: error: --dry-run {value}: give the number of ranks to plan (>= 1); leave "
        "--dry-run out to train")
    assert parse(["--data-path", "unused"]).memory.dry_run is None


def test_images_for_a_family_without_a_vision_tower_are_refused_by_the_planner():
    """--image-token-share 0.25 on Qwen3-MoE (no tower in its shapes) planned text only, saying
    nothing; a Step-3.7 config plans the family's tower (a text preset too: the tower it would get)."""
    qwen = ["--model-preset", "qwen3-moe-tiny", "--image-token-share", "0.25"]
    message = r"^--image-token-share 0.25: this model family has no vision tower to plan"
    with pytest.raises(ValueError, match=message):
        _planner(qwen)
    with pytest.raises(ValueError, match=message):
        plan_memory.planned(["--world-size", "2", "--search", *qwen])
    for model in MODELS:
        assert plan_inputs(*_planner([*model, "--image-token-share", "0.25"])).image_token_share == 0.25


def test_a_text_only_plan_of_a_vision_language_model_says_so(capsys):
    """--dry-run plans no images (the image flags are the planner's); it said nothing of it."""
    from training.planner.run import report

    assert report(*_dry_run(MODELS[1]), prog="pretrain_step37 --dry-run") == 0
    assert ("pretrain_step37 --dry-run: a vision-language model planned with text-only packs (no images): the "
            "images' cost is planned by tools/plan_memory.py --image-token-share F") in capsys.readouterr().out
    assert report(*_planner([*MODELS[1], "--image-token-share", "0.25"])) == 0
    assert "text-only" not in capsys.readouterr().out

"""A frozen part's routers keep their balancing bias: ``--freeze-language`` froze the routers'
weights but ``--moe-bias-update-rate`` still moved their ``e_score_correction_bias`` (a buffer,
outside autograd). core.train_step.update_router_biases skips a router whose parameters do not
train, and validation refuses the rate where no router trains (every one frozen, or LoRA)."""
from __future__ import annotations

import pytest
import torch

from core.finetune.freeze import freeze_parts
from core.train_step import update_router_biases
from models.step37 import Step37Config, Step37Model
from train_args import parse, validate

VLM = "step37-tiny-vlm"


def _biases(model):
    return [layer.router.e_score_correction_bias.clone() for layer in model.moe_layers()]


@pytest.mark.parametrize("frozen,moves", [((), True), (("vision",), True), (("language",), False)])
def test_routers_of_a_frozen_part_keep_their_bias(frozen, moves):
    model = Step37Model(Step37Config.preset(VLM), seed=0)
    freeze_parts(model, frozen)
    before = _biases(model)
    E = model.config.num_experts
    load = torch.arange(len(before) * E, dtype=torch.float32).reshape(len(before), E)  # uneven: every bias moves
    assert update_router_biases([model], {0: load}, 0.01) == (len(before) if moves else 0)
    after = _biases(model)
    assert all(not torch.equal(a, b) for a, b in zip(after, before)) if moves else \
        all(torch.equal(a, b) for a, b in zip(after, before))


def test_a_rate_with_every_router_frozen_is_refused_by_name():
    args = parse(["--data-path", "unused", "--model-preset", VLM, "--freeze-language", "--moe-bias-update-rate",
                  "0.01"])
    with pytest.raises(ValueError, match=r"^--moe-bias-update-rate 0.01 with --freeze-language: every router is in a "
                                         r"frozen part, whose balancing bias stays as loaded: drop"):
        validate(args, 1, check_files=False)
    validate(parse(["--data-path", "unused", "--model-preset", VLM, "--freeze-vision", "--moe-bias-update-rate",
                    "0.01"]), 1, check_files=False)  # the routers train: their biases move

"""Context-parallel layouts vs one process through the trainer's own ``train_step`` (the tiny
model: full and sliding layers, dense and MoE, MTP; the tiny Qwen3-MoE; the tiny DeepSeek-V3,
whose multi-head latent attention exchanges the compressed latent; the tiny GLM-4.5, these two
over three steps): loss, gradients, grad norm, MoE load and the parameters after each clipped SGD
step, 1e-5 relative as the other layouts
(``test_parallel_equivalence.py``). Pipeline p2p and halo exchanges are replayed under NCCL's
rules."""
from __future__ import annotations

import pytest

from tests.distributed.parallel_cases import check_layout

LAYOUTS = {  # name: (world, pp, ep, cp, family[, steps])
    "cp2": (2, 1, 1, 2, "step37"),
    "cp4": (4, 1, 1, 4, "step37"),
    "cp2_ep2": (2, 1, 2, 2, "step37"),   # EP carved out of DP x CP: the EP group is the CP group
    "cp2_pp2": (4, 2, 1, 2, "step37"),
    # the second family through the same generic decoder: softmax routing, a model-wide aux loss
    "cp2_ep2_qwen3_moe": (2, 1, 2, 2, "qwen3_moe"),
    # multi-head latent attention: the latent all-gathered, K/V expanded on each rank; group-limited
    # sigmoid routing with its balancing bias; three steps (the bias moved between them)
    "cp2_ep2_deepseek_v3": (2, 1, 2, 2, "deepseek_v3", 3),
    # GLM-4.5: partial rope, q/k norms and q/k/v biases under CP, its MTP depth on sharded labels
    "cp2_ep2_glm4_moe": (2, 1, 2, 2, "glm4_moe", 3),
}


def _case(world, pp, ep, cp, family, steps=1):
    bias_rate = 0.0 if family == "qwen3_moe" else 0.01  # Qwen3-MoE's softmax routers have no balancing bias
    return world, check_layout, (pp, 1, ep, "alltoall", 0.01, None, bias_rate, None, (), family, cp, steps)


# name -> (world, fn, args): the cases of one world size share one spawn (tests/distributed/conftest.py)
CASES = {name: _case(*layout) for name, layout in LAYOUTS.items()}


@pytest.mark.parametrize("case", LAYOUTS)
def test_cp_layout_matches_one_process(shared_ranks, case):
    shared_ranks.check((__name__, case))

"""PP / virtual PP / EP / DP layouts vs one process, through the trainer's own ``train_step``:
same loss, gradients, grad norm, MoE load statistics and parameters after a clipped SGD step
(fp32, gloo, the tiny model with every feature on: sliding and full layers, dense and MoE,
clamps, MTP on the last stage). Every layout's point-to-point operations, as the executor
issued them, are replayed under NCCL's rules (in order per rank pair, tags ignored, every
operation blocking until matched): no deadlock, every message paired with itself.

Tolerance 1e-5 relative per tensor: layouts sum the same terms in a different order."""
from __future__ import annotations

import pytest
import torch

from tests.distributed.lora_cases import check_lora_layout
from tests.distributed.parallel_cases import check_layout

LAYOUTS = {  # name: (world, pp, vpp, ep)
    "pp2": (2, 2, 1, 1),
    "pp2_vpp2": (2, 2, 2, 1),
    "ep2": (2, 1, 1, 2),
    "dp2": (2, 1, 1, 1),
    "pp2_ep2": (4, 2, 1, 2),
    "pp4_ep2": (8, 4, 1, 2),
}


# name -> (world, fn, args); the tests of one world size share one spawn (tests/distributed/conftest.py)
CASES = {name: (world, check_layout, (pp, vpp, ep)) for name, (world, pp, vpp, ep) in LAYOUTS.items()}
CASES.update({
    "compiled": (4, check_layout, (2, 1, 2, "alltoall", 0.0, None, 0.0, None,
                                   ("--compile", "--compile-backend", "aot_eager"))),
    "pp4_8_micro_batches": (4, check_layout, (4, 1, 1, "alltoall", 0.0, None, 0.0, 8)),
    "router_bias": (4, check_layout, (2, 1, 2, "alltoall", 0.0, None, 0.01)),
    "qwen3_moe_aux": (4, check_layout, (2, 1, 2, "alltoall", 0.05, None, 0.0, None, (), "qwen3_moe")),
    "allgather_aux": (2, check_layout, (1, 1, 2, "allgather", 0.01)),
    "ep_rank_without_tokens": (2, check_layout, (1, 1, 2, "alltoall", 0.0,
                                                 torch.tensor([100.0] * 4 + [0.0] * 4))),
    # LoRA (core/finetune/lora.py): three steps on the adapters of a frozen base
    "lora_pp2_ep2": (4, check_lora_layout, (2, 2)),
    "lora_fsdp_dp2": (2, check_lora_layout, (1, 1, 1, ("--data-parallel-sharding", "fsdp"))),
    "lora_cp2_qwen3_moe": (2, check_lora_layout, (1, 1, 2, (), "qwen3_moe")),
    # the MLA and GLM-4.5 families: three steps, group-limited sigmoid routing with its balancing
    # bias, a dense first layer, an MTP depth on the last stage; DeepSeek-V3 with q low-rank
    "pp2_ep2_deepseek_v3": (4, check_layout, (2, 1, 2, "alltoall", 0.01, None, 0.01, None, (), "deepseek_v3", 1, 3,
                                              {"num_nextn_predict_layers": 1})),
    "pp2_ep2_glm4_moe": (4, check_layout, (2, 1, 2, "alltoall", 0.01, None, 0.01, None, (), "glm4_moe", 1, 3)),
})


@pytest.mark.parametrize("case", LAYOUTS)
def test_layout_matches_one_process(shared_ranks, case):
    shared_ranks.check((__name__, case))


@pytest.mark.parametrize("case", ["compiled"])
def test_compiled_layers_match_one_process(shared_ranks, case):
    """PP2 x EP2 with --compile: the dense layers and MTP depths are whole fullgraph graphs,
    the MoE layers compiled around their all-to-all; equal to one eager process within the
    layouts' 1e-5, and a second step on packs with other document boundaries compiles nothing
    new. Backend aot_eager (dynamo + AOTAutograd, no code generation): it proves the tracing
    and the graphs on four CPU ranks in seconds; inductor's code is checked at one rank in
    tests/unit/test_compile.py."""
    shared_ranks.check((__name__, case))


@pytest.mark.parametrize("case", ["pp4_8_micro_batches"])
def test_executor_releases_sent_activations(shared_ranks, case):
    """PP4 with 8 micro-batches: every stage but the last sends 8 activations; each is released
    once its batch is retired, so the executor never holds more than the plan's live buffers
    (keeping a sent output's values until its backward, as the first wave did, exceeds them on
    the middle stages), and nothing at the end."""
    shared_ranks.check((__name__, case))


@pytest.mark.parametrize("case", ["router_bias"])
def test_router_bias_update_uses_the_whole_step_load(shared_ranks, case):
    """PP2 x EP2 (DP 2): the aux-loss-free bias moves by the sign of the load summed over every
    micro-batch and DP rank of the step (not the last micro-batch's), equal to one process."""
    shared_ranks.check((__name__, case))


@pytest.mark.parametrize("case", ["qwen3_moe_aux"])
def test_model_wide_aux_loss_across_pipeline_stages(shared_ranks, case):
    """Qwen3-MoE's aux loss averages the router statistics over every MoE layer of the model
    (transformers' form); at PP2 x EP2 the stages' counts travel with the pipeline's messages and
    each stage adds its exact share: loss, gradients and the update equal one process, and the
    messages with their carries replay under NCCL's rules."""
    shared_ranks.check((__name__, case))


@pytest.mark.parametrize("case", ["pp2_ep2_deepseek_v3", "pp2_ep2_glm4_moe"])
def test_new_families_at_pp2_ep2_over_three_steps(shared_ranks, case):
    """DeepSeek-V3 (multi-head latent attention, q low-rank, interleaved rope) and GLM-4.5 (q/k
    norms, q/k/v biases, partial rope) at PP2 x EP2: a dense first layer on stage 0, MoE layers
    with group-limited routing split over EP, the MTP depth on stage 1; three clipped SGD steps
    with momentum, the balancing bias moved after each, equal to one process step by step."""
    shared_ranks.check((__name__, case))


@pytest.mark.parametrize("case", ["allgather_aux"])
def test_allgather_dispatcher_and_aux_loss(shared_ranks, case):
    shared_ranks.check((__name__, case))


@pytest.mark.parametrize("case", ["ep_rank_without_tokens"])
def test_ep_rank_that_receives_no_tokens(shared_ranks, case):
    """Bias every token to experts 0-3 (EP rank 0): EP rank 1 gets nothing, forward and backward."""
    shared_ranks.check((__name__, case))


@pytest.mark.parametrize("case", ["lora_pp2_ep2", "lora_fsdp_dp2", "lora_cp2_qwen3_moe"])
def test_lora_layouts_match_one_process(shared_ranks, case):
    """LoRA at PP2 x EP2 (grouped expert adapters split with their experts, a first stage whose
    backward reaches no base weight), FSDP at DP2 (a sharded frozen base) and CP2 (Qwen3-MoE):
    three steps' losses equal one process's, the adapters after them too, and the frozen base is
    bit-identical with no gradient (lora_cases.check_lora_layout)."""
    shared_ranks.check((__name__, case))

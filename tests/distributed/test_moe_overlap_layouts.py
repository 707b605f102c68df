"""``--overlap-moe-expert-parallel-comm`` at EP2, PP2 x EP2 and --bf16 FSDP EP2 (DP4, the experts
sharded over expert-DP 2), and at EP2 with LoRA, FSDP gathered once and full recompute, and with
chunked recompute, and GLM-4.5 tiny whose MTP depth is an MoE block: three steps give the plain
schedule's losses and grad norms, every EP rank issues its all-to-alls in the same order (what
NCCL needs to not deadlock: one communicator runs its collectives in issue order), each rank's
pipeline batches and all-to-alls, in the order it issued them, replay under NCCL's rules with
every communicator on one queue (core/pipeline/nccl_replay.py), FSDP gathers the experts once
per forward and once per backward and reduces them once (the router once more per backward:
counted), and (PP2 x EP2, bf16 FSDP EP2) a run rebuilt from the flagged run's state after a step
repeats the next two bitwise (overlap_cases.check_overlap; the resume through checkpoint files,
with Muon: tests/distributed/test_storage_modes.py, resume-overlap-2).

fp32: 1e-6 relative (measured <= 3e-8: the routing statistics summed over two chunks in another
order). --bf16: 1e-6 too, the plain schedule's arithmetic (measured on every rank: the three
losses bitwise, the grad norm within 2e-13, the fp32 router's two GEMMs). Before, 7e-5 after the
first step, from two causes of about equal size (each alone left 1e-5 to 5e-5): a weight both
chunks use got two bf16 gradients summed, one rounding more than the plain GEMM, now one GEMM
over both chunks' tokens (core/moe/joined_grads.py); and the CPU sdpa backend cut each chunk's
documents into other band pieces, now each chunk's rows come from the whole pack's pieces
(core/transformer/sdpa_blocks.py:_part_attention)."""
from __future__ import annotations

import pytest

from tests.distributed.overlap_cases import check_gpu_part, check_overlap

CASES = {  # name: (world, fn, (pp, ep, flags))
    # rank 1 starts on a one-document pack; its resume goes through checkpoint files with Muon in
    # tests/distributed/test_storage_modes.py (resume-overlap-2)
    "ep2": (2, check_overlap, (1, 2, (), 1e-6, 1e-6, True, False)),
    "bf16_fsdp_ep2": (4, check_overlap, (1, 2, ("--bf16", "--data-parallel-sharding", "fsdp"), 1e-6, 1e-6)),
    "pp2_ep2": (4, check_overlap, (2, 2)),
    # what else it composes with: LoRA adapters (grouped ones on the experts) with FSDP gathering
    # once per step and full recompute (the rerun issues the forward's all-to-alls again); full
    # recompute a pack at a time with its inputs offloaded (two chunks inside each pack)
    "ep2_lora_fsdp_gather_once_recompute": (2, check_overlap, (1, 2, (
        "--lora-rank", "4", "--data-parallel-sharding", "fsdp", "--fsdp-gather-once", "--recompute-granularity", "full"), 1e-6, 1e-6, False, False)),
    "ep2_recompute_chunks_offload": (2, check_overlap, (1, 2, (
        "--recompute-granularity", "full", "--recompute-chunks", "2", "--micro-batch-size", "2",
        "--offload-recompute-inputs"), 1e-6, 1e-6, False, False)),
    # GLM-4.5 tiny: its MTP depth's block is an MoE block, overlapped as the decoder layers'
    "ep2_glm4_moe_mtp": (2, check_overlap, (1, 2, (), 1e-6, 1e-6, False, False, "glm4_moe")),
    # tools/gpu_check.sh's part j at its --tiny size on the CPU (benchmarks/gpu_parts/moe_overlap.py)
    "gpu_part_j_tiny": (2, check_gpu_part, ()),
}


@pytest.mark.parametrize("case", CASES)
def test_overlap_matches_the_plain_schedule(shared_ranks, case):
    shared_ranks.check((__name__, case))

"""``--overlap-moe-expert-parallel-comm`` at EP2, PP2 x EP2 and --bf16 FSDP EP2 (DP4, the experts
sharded over expert-DP 2), and at EP2 with LoRA, FSDP gathered once and full recompute, and with
chunked recompute: three steps give the plain schedule's losses and grad norms, every EP rank issues its all-to-alls in the same
order (what NCCL needs to not deadlock: one communicator runs its collectives in issue order),
FSDP gathers the experts once per forward and once per backward and reduces them once (the
router once more per backward: counted), and a resume repeats the uninterrupted run bitwise
(overlap_cases.check_overlap).

fp32: 1e-6 relative (measured <= 3e-8: the same sums over two chunks in another order). --bf16
is looser and its cause is known: the CPU sdpa backend cuts a chunk's documents into other band
pieces than the whole pack's (masked bf16 keys in other blocks; CUDA's varlen kernel is per
document), and a dense weight's gradient in a block is the bf16 sum of its two chunks' bf16
gradients, one rounding more than one GEMM's (the experts' sum waits in FSDP's fp32 accumulator).
Measured: 2.2e-7 on the first loss, 7e-5 on the later ones, 6e-4 on the grad norm; 1e-6 on the
first loss, 1e-3 after it (the bound of tests/e2e/test_bf16.py's layouts, which measure 1e-4
there against one process: any reordering in bf16 does as much after a step). Summing every
chunk gradient in fp32 (as --recompute-chunks does) would close it."""
from __future__ import annotations

import pytest

from tests.distributed.overlap_cases import check_overlap

CASES = {  # name: (world, fn, (pp, ep, flags))
    "ep2": (2, check_overlap, (1, 2, (), 1e-6, 1e-6, True)),  # rank 1 starts on a one-document pack
    "bf16_fsdp_ep2": (4, check_overlap, (1, 2, ("--bf16", "--data-parallel-sharding", "fsdp"), 1e-3, 1e-6)),
    "pp2_ep2": (4, check_overlap, (2, 2)),
    # what else it composes with: LoRA adapters (grouped ones on the experts) with FSDP gathering
    # once per step and full recompute (the rerun issues the forward's all-to-alls again); full
    # recompute a pack at a time with its inputs offloaded (two chunks inside each pack)
    "ep2_lora_fsdp_gather_once_recompute": (2, check_overlap, (1, 2, (
        "--lora-rank", "4", "--data-parallel-sharding", "fsdp", "--fsdp-gather-once", "--recompute-granularity", "full"), 1e-6, 1e-6, False, False)),
    "ep2_recompute_chunks_offload": (2, check_overlap, (1, 2, (
        "--recompute-granularity", "full", "--recompute-chunks", "2", "--micro-batch-size", "2",
        "--offload-recompute-inputs"), 1e-6, 1e-6, False, False)),
}


@pytest.mark.parametrize("case", CASES)
def test_overlap_matches_the_plain_schedule(shared_ranks, case):
    shared_ranks.check((__name__, case))

"""With the expert-parallel all-to-all, the only host read of a forward + backward is each MoE
layer's split sizes (one ``tolist`` per MoE layer per forward), on every rank."""
from __future__ import annotations

from collections import Counter

import pytest
import torch.distributed as dist

from core.parallel_state import ParallelSizes, ParallelState
from training.parallelize import parallelize
from tests.distributed.parallel_cases import micro_batches, run_args, tiny_config
from tests.host_reads import HostReads


def count_reads_ep2(rank, world):
    cfg = tiny_config()
    ps = ParallelState.build(ParallelSizes(world, ep=2), cfg.num_layers, cfg.num_experts)
    chunk = parallelize(cfg, ps, run_args(1, 1, 2))[0]
    b = micro_batches(world, 1, cfg.vocab_size)[ps.dp_rank][0]
    with HostReads() as h:
        out = chunk(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels)
        (out.loss_sum + 0.3 * sum(out.mtp_loss_sums)).backward()
    kinds = Counter(what for what, _ in h.reads)
    assert kinds == {"tolist": len(chunk.moe_layers())}, h.reads
    # through the seam a traced step fills with the planner's balanced routing
    assert all("host_values.py" in where for _, where in h.reads), h.reads
    dist.barrier()


# in the spawn of the other 2-rank cases (tests/distributed/conftest.py)
CASES = {"ep2": (2, count_reads_ep2, ())}


@pytest.mark.parametrize("case", CASES)
def test_all_to_all_reads_only_its_split_sizes(shared_ranks, case):
    shared_ranks.check((__name__, case))

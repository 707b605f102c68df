"""Muon's Newton-Schulz split over the ranks that shard the matrices (core/optim/muon_split.py):
the same bits as every rank orthogonalising every whole matrix, about 1/D of the work per rank,
two all-to-alls per batch and no all-gather."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from core.optim.muon import Muon, newton_schulz
from core.optim.muon_split import ns_flops, owners, row_counts, split_orthogonalise
from tests.distributed.harness import run_ranks

# rows below the world size (empty shards), rows not divisible by it, wide and tall matrices
SHAPES = [(64, 48), (3, 40), (48, 96), (17, 5), (40, 40), (96, 32), (2, 7)]


def _counting(calls: list):
    def ns(g):
        calls.append(tuple(g.shape))
        return newton_schulz(g)
    return ns


def split_equals_replicated(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same whole matrices on every rank
    whole = [torch.randn(s) for s in SHAPES]
    grads = [distribute_tensor(w, mesh, [Shard(0)]) for w in whole]
    calls, collectives = [], []
    real = dist.all_to_all_single, dist.all_gather_into_tensor
    dist.all_to_all_single = lambda *a, **k: (collectives.append("a2a"), real[0](*a, **k))[1]
    dist.all_gather_into_tensor = lambda *a, **k: (collectives.append("gather"), real[1](*a, **k))[1]
    try:
        mine = split_orthogonalise(grads, _counting(calls), torch.bfloat16)
    finally:
        dist.all_to_all_single, dist.all_gather_into_tensor = real
    for w, g, rows in zip(whole, grads, mine):
        expect = torch.chunk(newton_schulz(w), world)  # what every rank computed before
        expect = expect[rank] if rank < len(expect) else w[:0].to(torch.bfloat16)
        assert rows.dtype == torch.bfloat16 and torch.equal(rows, expect), (w.shape, rank)
        assert rows.shape == g.to_local().shape
    assert collectives == ["a2a", "a2a"]
    own = owners(SHAPES, world)
    assert sorted(calls) == sorted(s for s, o in zip(SHAPES, own) if o == rank)
    loads = [sum(ns_flops(s) for s, o in zip(SHAPES, own) if o == r) for r in range(world)]
    # the largest matrix bounds one rank's share; the rest is dealt out below the even share
    assert max(loads) <= max(sum(loads) / world, max(ns_flops(s) for s in SHAPES)) + 1e-6

    # Muon's step: the split and the replicated paths give the same parameters bit for bit
    params = {}
    for split in (True, False):
        ps = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in whole]
        for p, w in zip(ps, whole):
            p.grad = distribute_tensor(w.flip(0) * 0.5, mesh, [Shard(0)])
        Muon(ps, lr=0.1, momentum=0.0, weight_decay=0.01, split=split).step()
        params[split] = [p.to_local().clone() for p in ps]
    for a, b in zip(params[True], params[False]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("world", [3])
def test_split_newton_schulz_equals_every_rank_computing_it(tmp_path, world):
    run_ranks(world, split_equals_replicated, tmpdir=str(tmp_path))


def test_owners_are_balanced_and_deterministic():
    shapes = [(8192, 4096), (1024, 4096), (1024, 4096), (4096, 8192)] * 4 + [(1280, 4096)] * 9
    own = owners(shapes, 8)
    assert own == owners(list(shapes), 8)
    loads = [sum(ns_flops(s) for s, o in zip(shapes, own) if o == r) for r in range(8)]
    assert max(loads) / (sum(loads) / 8) < 1.1  # the largest matrix is 1/8 of the even share here
    assert row_counts(10, 4) == [3, 3, 3, 1] and row_counts(2, 3) == [1, 1, 0] and row_counts(9, 4) == [3, 3, 3, 0]

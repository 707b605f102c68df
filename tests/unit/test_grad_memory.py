"""What gradient sync and the grad norm allocate (bytes counted by torch's profiler on the host;
the same ops allocate the same bytes on a GPU): the sync sums in bounded fp32 buckets, not one
flat copy of every gradient (+34 GB at sync for 8.6 B dense parameters), and the norm never makes
an fp64 copy of a tensor (``vector_norm(dtype=float64)`` casts the whole tensor first)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import core.distributed.grads as grads
from core.model_api import ParamSpec
from tests.alloc_bytes import largest_allocation

MiB = 2**20


def _params(n: int, numel: int, dtype=torch.float32):
    torch.manual_seed(0)
    out = []
    for _ in range(n):
        p = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))
        p.grad = torch.randn(numel, dtype=dtype)
        out.append((p, ParamSpec()))
    return out


def _state():
    """One stage, DP (and CP) rank 0 of a DP x CP group whose all-reduce is faked (a one-rank sum)."""
    return SimpleNamespace(group=lambda kind: object() if kind == "dp_cp" else None, ranks=lambda kind: [0],
                           is_first_stage=True, dp_rank=0, cp_rank=0, expert_dp_rank=0)


def test_buckets_are_consecutive_and_bounded():
    t = [torch.empty(n * MiB // 4) for n in (3, 3, 5, 2, 7)]
    assert [[x.numel() * 4 // MiB for x in b] for b in grads.buckets(t, 6 * MiB)] == [[3, 3], [5], [2], [7]]


def test_sync_allocates_one_bucket_not_a_copy_of_every_gradient(monkeypatch):
    summed = []
    monkeypatch.setattr(grads.dist, "all_reduce", lambda t, group=None: summed.append(t.numel()))
    monkeypatch.setattr(grads, "BUCKET_BYTES", 4 * MiB, raising=False)
    specs = _params(16, MiB // 4, torch.bfloat16)  # 16 bf16 gradients, 8 MiB; 16 MiB in fp32
    before = [p.grad.clone() for p, _ in specs]
    peak = largest_allocation(lambda: grads.sync_gradients(specs, _state()))
    assert sum(summed) == 16 * MiB // 4  # every element went over the wire
    assert peak <= 4 * MiB, peak  # one fp32 bucket (a single flat buffer was 16 MiB in fp32)
    assert all(torch.equal(p.grad, b) for (p, _), b in zip(specs, before))  # a one-rank sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_norm_makes_no_full_fp64_copy(monkeypatch, dtype):
    monkeypatch.setattr(grads, "_NORM_BLOCK", 2**16, raising=False)
    specs = _params(2, 2 * MiB, dtype)  # two gradients of 2 M elements: 16 MiB each as fp64
    norm = None

    def run():
        nonlocal norm
        norm = grads.grad_norm(specs, _state())

    assert largest_allocation(run) <= 2**16 * 8  # one block in fp64
    ref = torch.cat([p.grad.double() for p, _ in specs]).norm()
    # fp64 sums of exactly converted squares: ~1e-15 relative; 1e-12 leaves 1000x
    assert abs(float(norm) - float(ref)) <= 1e-12 * float(ref)

"""Rank-side bodies of the context-parallel attention tests (importable by spawned processes)."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from core.context_parallel.attention import ContextParallel
from core.context_parallel.exchange import CPComm
from core.pipeline.nccl_replay import replay
from core.transformer.attention_backends import DocLayout, sdpa_attention
from data.cp_shard import shard_batch
from data.indexed_dataset import InMemoryDataset
from data.thd import build_thd_batch

HQ, HKV, D, SCALE = 4, 2, 8, 0.35
# windows: the tiny model's 8, one longer than most chunks (halo over several ranks), and 3
WINDOWS = (None, 8, 21, 3)


def pack(N: int, seed: int = 0):
    """One pack of documents padded to multiples of 2N: odd lengths, documents shorter than 2N
    and than the windows, one long document whose chunks are longer than the window at N = 2."""
    rng = np.random.default_rng([seed, N])
    lengths = [1, 2 * N - 1, 5, 3 * 2 * N + 1, 60, 2, 17]
    S = sum(-(-n // (2 * N)) * 2 * N for n in lengths) + 2 * N  # a trailing pad too
    docs = [rng.integers(0, 100, n) for n in lengths]
    segs = np.array([[i, 0, n] for i, n in enumerate(lengths)], dtype=np.int64)
    return build_thd_batch([segs], InMemoryDataset(docs), S, 0, pad_multiple=2 * N)


def _reference(q, k, v, g, layout, window):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = sdpa_attention(q, k, v, layout, window, SCALE)
    (out * g).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _sharded(cp, q, k, v, g, shard_params, window):
    idx = torch.from_numpy(shard_params.cp.index)
    q, k, v = (t.detach()[idx].clone().requires_grad_() for t in (q, k, v))
    out = cp(q, k, v, DocLayout.from_params(shard_params), window, SCALE, "sdpa")
    (out * g[idx]).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def check_cp_attention(rank, world):
    """At CP 2, 4 and 8 (the first N ranks), every window: outputs and the gradients of q, k, v
    equal the unsharded sdpa layer in fp64 (1e-10 relative: the same terms summed in another
    order, ~1e-16, and the all-gather's reduce-scatter adds N partial sums); then a change to
    one document's q, k, v leaves every other document's outputs and gradients bitwise equal;
    the halo exchanges, as issued, replay under NCCL's rules."""
    sizes = [n for n in (2, 4, 8) if n <= world]
    groups = {n: dist.new_group(list(range(n))) for n in sizes}  # every rank creates every group
    for N in sizes:
        if rank >= N:
            continue
        comm = CPComm(groups[N], list(range(N)), rank)
        comm.trace = []
        cp = ContextParallel(comm)
        b = pack(N)
        params = shard_batch(b, N, rank).packed_seq_params
        layout = DocLayout.from_params(b.packed_seq_params)
        T = b.tokens.numel()
        gen = torch.Generator().manual_seed(N)
        q, k, v, g = (torch.randn(T, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ))
        doc1 = slice(*b.packed_seq_params.cu_seqlens_padded[1:3].tolist())
        for window in WINDOWS:
            ref = _reference(q, k, v, g, layout, window)
            got = _sharded(cp, q, k, v, g, params, window)
            idx = torch.from_numpy(params.cp.index)
            for name, a, want in zip(("out", "dq", "dk", "dv"), got, ref):
                err = _rel(a, want[idx])
                assert err < 1e-10, f"CP{N} rank {rank} window {window}: {name} differs ({err:.2e})"
            q2, k2, v2 = (t.clone() for t in (q, k, v))
            for t in (q2, k2, v2):
                t[doc1] += 1.0
            moved = _sharded(cp, q2, k2, v2, g, params, window)
            other = ~((idx >= doc1.start) & (idx < doc1.stop))
            for name, a, c in zip(("out", "dq", "dk", "dv"), got, moved):
                assert torch.equal(a[other], c[other]), f"CP{N} window {window}: {name} of other documents moved"
            assert not torch.equal(got[0][~other], moved[0][~other]), "the changed document's outputs did not move"
        traces = [None] * N
        dist.all_gather_object(traces, comm.trace, group=groups[N])
        if rank == 0:
            replay(dict(enumerate(traces)))
            assert sum(len(b) for t in traces for b in t) > 0
    dist.barrier()

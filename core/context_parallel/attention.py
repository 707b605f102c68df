"""Context-parallel attention on a CP rank's shard: exact against the unsharded layer.

``ContextParallel`` is what ``apply_context_parallel`` gives every attention module; called with
the layer's local ``q [T/N, Hq, D]``, ``k``/``v [T/N, Hkv, D]`` and the micro-batch's layout
(whose ``params.cp`` is this rank's ``CPShard``), it

1. builds (once per micro-batch and window, on the host, ``plan.py``) which keys each local
   chunk needs: its document's prefix (full attention) or its halo of ``window - 1`` keys;
2. moves K/V: an all-gather over the CP group (full) or the halo exchange (sliding,
   ``exchange.py``), and cuts the key buffer (the rows the local chunks read) from the pool;
3. runs one attention call over the segments (query chunk, its keys), causal aligned to the end
   of the keys: torch's flash ``varlen_attn`` with ``cu_seqlens_q != cu_seqlens_k`` on CUDA
   (bf16), or the sdpa reference per segment (CPU, any dtype);
4. zeroes the outputs of padding rows (as the unsharded sdpa backend returns them), so no
   gradient flows from padding queries into real keys.

Multi-head latent attention (``core/transformer/mla.py``) calls :meth:`ContextParallel.latent`
instead: step 2 moves each token's compressed latent (``kv_lora_rank`` normed latent and the
roped shared key, ``[T/N, kv_lora_rank + rope]``) rather than the expanded per-head K/V, and the
module's own ``expand`` (``kv_b_proj``) turns the key buffer's latent rows into K and V on every
rank before step 3. The value head dim may differ from the query/key one there: the sdpa
reference computes with it as it is, ``varlen`` gets V zero-padded and its output cropped.

Only the index tensors derived from host metadata travel to the device (pinned, asynchronous);
nothing reads the device. ``--compile`` is refused with CP (the exchanges are host-planned
collectives inside the layer).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from core.context_parallel.exchange import CPComm, halo_exchange
from core.context_parallel.plan import SegmentPlan, full_plan, halo_plan
from core.distributed.collectives import all_gather
from core.transformer import attention_backends as ab

CP_BACKENDS = ("sdpa", "varlen")  # what --attention-backend may resolve to under CP
QUERY_BLOCK = 512  # CPU reference: queries per masked sdpa call on full layers (bounds the mask)


def _to_device(a: np.ndarray, device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)  # no host wait on the GPU's queue
    return t.to(device)


class DevicePlan:
    """A ``SegmentPlan`` with its index tensors on the device (int64 rows, int32 boundaries)."""

    def __init__(self, plan: SegmentPlan, device):
        self.host = plan
        self.key_index = _to_device(plan.key_index, device)
        self.cu_q = _to_device(np.asarray(plan.cu_q, dtype=np.int32), device)
        self.cu_k = _to_device(np.asarray(plan.cu_k, dtype=np.int32), device)
        self.send = {s: _to_device(idx, device) for s, idx in plan.send.items()}
        self.recv = dict(plan.recv)


def _band(nq: int, q0: int, k0: int, nk: int, window: int | None, device) -> torch.Tensor:
    """Mask of queries at key-aligned positions ``q0..q0+nq-1`` over keys ``k0..k0+nk-1``."""
    d = (torch.arange(q0, q0 + nq, device=device)[:, None] - torch.arange(k0, k0 + nk, device=device)[None, :])
    return (d >= 0) & (d < window) if window is not None else d >= 0


def sdpa_segments(q, k, v, plan: SegmentPlan, window: int | None, scale: float) -> torch.Tensor:
    """The reference: per segment, blocks of queries against the keys they can see (masked
    sdpa), memory O(block x keys)."""
    out = q.new_zeros(*q.shape[:2], v.shape[-1])  # the value head dim may differ (MLA)
    gqa = q.shape[1] != k.shape[1]
    block = window or QUERY_BLOCK
    for qs, qe, ks, ke in zip(plan.cu_q[:-1], plan.cu_q[1:], plan.cu_k[:-1], plan.cu_k[1:]):
        shift = (ke - ks) - (qe - qs)  # query i sits at key position shift + i
        for a in range(0, qe - qs, block):
            b = min(a + block, qe - qs)
            lo = max(0, shift + a - window + 1) if window is not None else 0
            hi = shift + b
            qd = q[qs + a:qs + b].transpose(0, 1)
            kd, vd = (t[ks + lo:ks + hi].transpose(0, 1) for t in (k, v))
            mask = _band(b - a, shift + a, lo, hi - lo, window, q.device)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[qs + a:qs + b] = o.transpose(0, 1)
    return out


def varlen_segments(q, k, v, plan: DevicePlan, window: int | None, scale: float) -> torch.Tensor:
    """One flash ``varlen_attn`` call: query and key boundaries differ, causal bottom-right;
    the keywords this torch's ``varlen_attn`` has (torch 2.11 has no ``enable_gqa``: GQA goes to
    flash as it is, ``attention_backends.VarlenAPI``)."""
    if ab.VARLEN is None:
        raise RuntimeError("--attention-backend varlen needs torch.nn.attention.varlen (torch >= 2.10)")
    kw = ab.VARLEN.kwargs(window, scale, q.shape[1] != k.shape[1], q.shape[-1])
    return ab._varlen_kernel()(q, k, v, plan.cu_q, plan.cu_k, plan.host.max_q, plan.host.max_k, **kw)


def device_plan(shard, window: int | None, device) -> DevicePlan:
    """The micro-batch's plan for ``window`` (``None``: full) on ``device``, built once and
    cached in ``shard.plans``."""
    key = ("full" if window is None else window, str(device))
    if key not in shard.plans:
        host = full_plan(shard) if window is None else halo_plan(shard, window)
        shard.plans[key] = DevicePlan(host, device)
    return shard.plans[key]


def attend_segments(q, pool, kv_heads: int, plan: DevicePlan, valid, window: int | None, scale: float,
                    backend: str) -> torch.Tensor:
    """Steps 3 and 4 of the module docstring, after the exchange: the key buffer cut from
    ``pool [rows, 2 Hkv, D]`` (K then V heads), one attention call over the segments, padding
    rows zeroed (``valid [T/N]`` bool). No process group: tests and the GPU check call it with
    a pool made on one process."""
    keys = pool.index_select(0, plan.key_index)
    return attend_keys(q, keys[:, :kv_heads], keys[:, kv_heads:], plan, valid, window, scale, backend)


def attend_keys(q, kb, vb, plan: DevicePlan, valid, window: int | None, scale: float,
                backend: str) -> torch.Tensor:
    """Steps 3 and 4 on a key buffer already cut (``kb [rows, Hkv, D]``, ``vb [rows, Hkv, Dv]``):
    ``varlen`` needs ``Dv == D``, so V is zero-padded for it and the output cropped (exact: zero
    value columns add nothing to the kept ones)."""
    dv = vb.shape[-1]
    if backend == "varlen":
        if dv != q.shape[-1]:
            if dv > q.shape[-1]:  # zero q/k dims add nothing to q.k
                q, kb = (F.pad(t, (0, dv - t.shape[-1])) for t in (q, kb))
            else:
                vb = F.pad(vb, (0, q.shape[-1] - dv))
        o = varlen_segments(q, kb.contiguous(), vb.contiguous(), plan, window, scale)[..., :dv]
    else:
        o = sdpa_segments(q, kb, vb, plan.host, window, scale)
    return o * valid.to(o.dtype)[:, None, None]


class ContextParallel:
    """Attention over the CP group (see the module docstring)."""

    def __init__(self, comm: CPComm):
        self.comm = comm

    def key_buffer(self, rows, layout, window: int | None, backend: str) -> tuple[DevicePlan, torch.Tensor]:
        """Steps 1 and 2 for per-token ``rows [T/N, ...]`` (K/V, or MLA's latent): the plan and
        the key buffer the local chunks read, cut from the all-gathered (full) or halo (sliding)
        pool."""
        shard = layout.params.cp
        check_shard(self, shard, backend)
        plan = device_plan(shard, window, rows.device)
        pool = all_gather(rows, self.comm.group) if window is None else \
            halo_exchange(rows, plan.send, plan.recv, self.comm)
        return plan, pool.index_select(0, plan.key_index)

    def __call__(self, q, k, v, layout, window: int | None, scale: float, backend: str) -> torch.Tensor:
        h = k.shape[1]
        kv = torch.cat([k, v], dim=1)  # one exchange for both: [T/N, 2 Hkv, D]
        plan, keys = self.key_buffer(kv, layout, window, backend)
        return attend_keys(q, keys[:, :h], keys[:, h:], plan, layout.params.cp.valid, window, scale, backend)

    def latent(self, q, latent, expand, layout, window: int | None, scale: float, backend: str) -> torch.Tensor:
        """MLA: ``latent [T/N, C]`` (each token's compressed K/V) is what moves; ``expand(rows)
        -> (k [rows, H, D], v [rows, H, Dv])`` runs on the key buffer's latent rows, here."""
        plan, rows = self.key_buffer(latent, layout, window, backend)
        k, v = expand(rows)
        return attend_keys(q, k, v, plan, layout.params.cp.valid, window, scale, backend)


def check_shard(cp: ContextParallel | None, shard, backend: str) -> None:
    """``ValueError`` when the micro-batch and the model disagree about context parallelism."""
    if cp is None:
        raise ValueError("this micro-batch is a context-parallel shard but the model was not "
                         "parallelized with --context-parallel-size (training/parallelize.py)")
    if shard is None:
        raise ValueError(f"--context-parallel-size {cp.comm.size}: the micro-batch is not sharded; "
                         "load it with data.cp_shard (CPShardLoader / shard_batch)")
    if shard.size != cp.comm.size or shard.rank != cp.comm.rank:
        raise ValueError(f"the micro-batch is CP rank {shard.rank} of {shard.size}'s shard, but this "
                         f"is CP rank {cp.comm.rank} of --context-parallel-size {cp.comm.size}")
    if backend not in CP_BACKENDS:
        raise ValueError(f"--attention-backend {backend} does not support --context-parallel-size > 1: "
                         "use auto (varlen on CUDA, sdpa on CPU)")


def cp_attention(cp: ContextParallel | None, q, k, v, layout, window, scale, backend) -> torch.Tensor:
    """What an attention module calls when it has a CP group or gets a CP shard."""
    if cp is None:
        check_shard(None, layout.params.cp, backend)
    return cp(q, k, v, layout, window, scale, backend)


def cp_latent_attention(cp: ContextParallel | None, q, latent, expand, layout, window, scale,
                        backend) -> torch.Tensor:
    """What a latent-attention module (MLA) calls when it has a CP group or gets a CP shard
    (``backend`` as the module has it: ``auto`` resolved here, as ``attend`` does)."""
    backend = ab.resolve_backend(backend, q.device, q.dtype)
    if cp is None:
        check_shard(None, layout.params.cp, backend)
    return cp.latent(q, latent, expand, layout, window, scale, backend)

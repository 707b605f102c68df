"""Gradient synchronisation, global grad norm and clipping across pp, ep and dp.

Each parameter's ``ParamSpec`` (declared by the model, ``core/model_api.py``) says where its
replicas live: ``"dp"`` (dense: one copy per data-parallel and context-parallel rank, EP ranks
included: the ``dp_cp`` group) or ``"expert_dp"`` (an expert shard: one copy per
expert-data-parallel rank, which spans CP ranks too). The loss is already
normalised by the global token count, so replicas' gradients are *summed*. A ``tied``
parameter (e.g. the embedding that a last stage holds for MTP) has a copy on the first stage:
their gradients are summed over the ``embedding`` group.

The grad norm counts each distinct parameter once: dense ones on DP and CP rank 0 of each stage,
expert shards on expert-DP rank 0 of each (stage, EP rank), tied copies only on stage 0, then
one all-reduce over the world.

Memory: gradients that this module sums travel in buckets of at most ``BUCKET_BYTES`` (fp32 on
the wire), one at a time, so the sync adds one bucket to the gradients' memory rather than a copy
of them all (+34 GB for 8.6 B dense parameters in one flat buffer); a tensor already fp32 on the
wire's device and larger than a bucket is summed in place. Norms reduce each gradient in its own
in fp64 a block of 16 M elements at a time, never making an fp64 copy of a whole tensor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from core.distributed.host_values import host_values
from core.parallel_state import ParallelState, local_device


def sharded(t: torch.Tensor) -> bool:
    """An FSDP shard whose replicas FSDP reduces; a DTensor on a one-rank mesh (mixed
    precision without sharding) is whole on this rank and summed here like a plain tensor."""
    return isinstance(t, DTensor) and t.device_mesh.size() > 1


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly FSDP-sharded) tensor, as a plain tensor view."""
    return t.to_local() if isinstance(t, DTensor) else t


BUCKET_BYTES = 256 * 2**20  # fp32 bytes of one all-reduce bucket: few enough launches, bounded memory
_NORM_BLOCK = 2**24         # elements cast to fp64 at a time for a norm (128 MiB)


def buckets(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of ``tensors`` whose fp32 bytes stay within ``cap`` (a larger tensor
    makes a group of its own). Pure: e.g. 3, 3, 5 and 2 MiB at a 6 MiB cap -> [3, 3], [5], [2]."""
    out, size = [], cap
    for t in tensors:
        n = t.numel() * 4
        if not out or size + n > cap:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out


def _all_reduce_flat(tensors: list[torch.Tensor], group, bucket_bytes: int | None = None) -> None:
    """Sum ``tensors`` over ``group`` in fp32 buckets (bf16 gradients of remainder-stored
    parameters are summed in fp32 and rounded once), one bucket alive at a time."""
    if not tensors or group is None:
        return
    device = local_device()  # NCCL wants the GPU
    for bucket in buckets(tensors, bucket_bytes or BUCKET_BYTES):
        t = bucket[0]
        if len(bucket) == 1 and t.dtype == torch.float32 and t.device == device and t.is_contiguous():
            dist.all_reduce(t, group=group)  # in place: no copy at all
            continue
        flat = _flatten_dense_tensors(bucket)
        on_wire = flat.to(device, torch.promote_types(flat.dtype, torch.float32))
        dist.all_reduce(on_wire, group=group)
        for t, synced in zip(bucket, _unflatten_dense_tensors(on_wire.to(flat.device), bucket)):
            t.copy_(synced)
        del flat, on_wire  # before the next bucket is made: one alive at a time


def square_norm(g: torch.Tensor) -> torch.Tensor:
    """``|g|^2`` in fp64, on ``g``'s device, without a full-size fp64 copy of ``g``
    (``vector_norm(dtype=float64)`` casts the whole tensor first): blocks of ``_NORM_BLOCK``
    elements are cast and reduced one at a time (fp32 accumulation would lose ~1e-5 over a few
    million elements on the host)."""
    if g.dtype == torch.float64 or g.numel() <= _NORM_BLOCK:
        return torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
    blocks = g.reshape(-1).split(_NORM_BLOCK)
    return torch.stack([torch.linalg.vector_norm(b, dtype=torch.float64) for b in blocks]).square().sum()


def sync_gradients(specs: list, pstate: ParallelState) -> None:
    """Sum gradients over their replicas (one flat bucket per group). ``specs``: ``(parameter,
    ParamSpec)`` pairs (``core.model_api.specs_of``). FSDP-sharded parameters were already
    reduce-scattered by FSDP; only tied parameters' shards meet here."""
    for p, _ in specs:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for kind, group in (("dp", "dp_cp"), ("expert_dp", "expert_dp")):
        _all_reduce_flat([local(p.grad) for p, spec in specs if spec.replicated_over == kind
                          and not sharded(p)], pstate.group(group))
    if len(pstate.ranks("embedding")) > 1:
        _all_reduce_flat([local(p.grad) for p, spec in specs if spec.tied], pstate.group("embedding"))


def owns(p, spec, pstate: ParallelState) -> bool:
    """Whether this rank's copy of ``p`` counts in the global grad norm (each distinct parameter
    once: the first stage's copy of a tied one, every rank's FSDP shard, the first replica of a
    replicated one)."""
    if spec.tied and not pstate.is_first_stage:
        return False  # the copy that is not on the first stage
    if sharded(p):
        return True  # a shard: every rank holds a different part
    if spec.replicated_over == "dp":
        return pstate.dp_rank == 0 and pstate.cp_rank == 0
    return pstate.expert_dp_rank == 0


def grad_norm(specs: list, pstate: ParallelState, extra_sq: torch.Tensor | None = None) -> torch.Tensor:
    """Global L2 norm of the gradient, each distinct parameter counted once (per-tensor squares
    summed in fp64);
    ``extra_sq``: this rank's square norm of gradients already consumed (stepped in the backward)."""
    terms, device = [], local_device()  # offloaded shards sit on the host; NCCL wants the GPU
    if extra_sq is not None:
        terms.append(extra_sq.double())
    for p, spec in specs:
        if owns(p, spec, pstate) and p.grad is not None:
            terms.append(square_norm(local(p.grad).detach()))  # no full-size copy (host shards too)
    # one sum on one device (offloaded shards may sit on the host), no per-tensor sync
    sq = torch.stack([t.to(device) for t in terms]).sum() if terms else \
        torch.zeros((), dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    return sq.sqrt()


def clip_gradients(params, max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """Scale the fp32 gradients of ``params`` (every parameter this rank holds) by
    ``min(1, max_norm / norm)``; returns the factor used. Gradients in a narrower dtype (bf16, of
    remainder-stored parameters) are left exact: the optimizer applies the factor in fp32
    (``CompositeOptimizer.set_grad_scale``) rather than round the scaled gradient to bf16."""
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    copies = {}  # the factor once per (device, dtype), not once per tensor
    for p in params:
        if p.grad is not None and local(p.grad).dtype in (torch.float32, torch.float64):
            g = local(p.grad)
            key = (g.device, g.dtype)
            if key not in copies:
                copies[key] = factor.to(g.device, g.dtype)
            g.mul_(copies[key])
    return factor


def reduce_step_metrics(values: list[torch.Tensor]) -> list[float]:
    """Sum scalar tensors over the world in one fp64 all-reduce (one host sync); every rank must
    pass the same number of values."""
    t = torch.stack([v.detach().to(values[0].device, torch.float64).reshape(()) for v in values])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return host_values(t)

"""Gradient synchronisation, global grad norm and clipping across pp, ep and dp.

Each parameter's ``ParamSpec`` (declared by the model, ``core/model_api.py``) says where its
replicas live: ``"dp"`` (dense: one copy per data-parallel rank, EP ranks included) or
``"expert_dp"`` (an expert shard: one copy per expert-data-parallel rank). The loss is already
normalised by the global token count, so replicas' gradients are *summed*. A ``tied``
parameter (e.g. the embedding that a last stage holds for MTP) has a copy on the first stage:
their gradients are summed over the ``embedding`` group.

The grad norm counts each distinct parameter once: dense ones on DP rank 0 of each stage,
expert shards on expert-DP rank 0 of each (stage, EP rank), tied copies only on stage 0, then
one all-reduce over the world.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from core.parallel_state import ParallelState, local_device


def sharded(t: torch.Tensor) -> bool:
    """An FSDP shard whose replicas FSDP reduces; a DTensor on a one-rank mesh (mixed
    precision without sharding) is whole on this rank and summed here like a plain tensor."""
    return isinstance(t, DTensor) and t.device_mesh.size() > 1


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly FSDP-sharded) tensor, as a plain tensor view."""
    return t.to_local() if isinstance(t, DTensor) else t


def _all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in one fp32 bucket (bf16 gradients of remainder-stored
    parameters are summed in fp32 and rounded once)."""
    if not tensors or group is None:
        return
    flat = _flatten_dense_tensors(tensors)
    on_wire = flat.to(local_device(), torch.promote_types(flat.dtype, torch.float32))  # NCCL wants the GPU
    dist.all_reduce(on_wire, group=group)
    for t, synced in zip(tensors, _unflatten_dense_tensors(on_wire.to(flat.device), tensors)):
        t.copy_(synced)


def sync_gradients(specs: list, pstate: ParallelState) -> None:
    """Sum gradients over their replicas (one flat bucket per group). ``specs``: ``(parameter,
    ParamSpec)`` pairs (``core.model_api.specs_of``). FSDP-sharded parameters were already
    reduce-scattered by FSDP; only tied parameters' shards meet here."""
    for p, _ in specs:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for kind in ("dp", "expert_dp"):
        _all_reduce_flat([local(p.grad) for p, spec in specs if spec.replicated_over == kind
                          and not sharded(p)], pstate.group(kind))
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
    return pstate.dp_rank == 0 if spec.replicated_over == "dp" else pstate.expert_dp_rank == 0


def grad_norm(specs: list, pstate: ParallelState, extra_sq: torch.Tensor | None = None) -> torch.Tensor:
    """Global L2 norm of the gradient, each distinct parameter counted once (fp64 sum);
    ``extra_sq``: this rank's square norm of gradients already consumed (stepped in the backward)."""
    terms, device = [], local_device()  # offloaded shards sit on the host; NCCL wants the GPU
    if extra_sq is not None:
        terms.append(extra_sq.double())
    for p, spec in specs:
        if owns(p, spec, pstate) and p.grad is not None:
            # fp64 accumulation without a full-size fp64 copy (offloaded gradients sit on the host)
            terms.append(torch.linalg.vector_norm(local(p.grad).detach(), dtype=torch.float64) ** 2)
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
    return t.tolist()

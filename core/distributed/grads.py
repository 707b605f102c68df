"""Gradient synchronisation, global grad norm and clipping across pp, ep and dp.

Every parameter carries ``replicated_over``: ``"dp"`` (dense: one copy per data-parallel rank,
EP ranks included) or ``"expert_dp"`` (an expert shard: one copy per expert-data-parallel
rank). The loss is already normalised by the global token count, so replicas' gradients are
*summed*. The embedding that a last stage holds for MTP is a second copy of stage 0's
(``shared_embedding``): their gradients are summed over the ``embedding`` group.

The grad norm counts each distinct parameter once: dense ones on DP rank 0 of each stage,
expert shards on expert-DP rank 0 of each (stage, EP rank), tied copies only on stage 0, then
one all-reduce over the world.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from core.parallel_state import ParallelState


def tag_parameters(chunks, pstate: ParallelState) -> list[torch.nn.Parameter]:
    """Set replication metadata on every parameter of this rank's chunks; return them."""
    params = []
    for chunk in chunks:
        # with MTP and a pipeline, the first and the last stage each hold the embedding
        shared = chunk.config.num_mtp_layers > 0 and pstate.sizes.pp > 1
        for name, p in chunk.named_parameters():
            p.replicated_over = "expert_dp" if ".moe.experts." in name else "dp"
            p.shared_embedding = shared and name == "embed_tokens.weight"
            params.append(p)
    return params


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly FSDP-sharded) tensor, as a plain tensor view."""
    return t.to_local() if isinstance(t, DTensor) else t


def _all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    if not tensors or group is None:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)


def sync_gradients(params: list, pstate: ParallelState) -> None:
    """Sum gradients over their replicas (one flat bucket per group). FSDP-sharded parameters
    were already reduce-scattered by FSDP; only the shared embedding's shards meet here."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for kind in ("dp", "expert_dp"):
        _all_reduce_flat([p.grad for p in params if p.replicated_over == kind
                          and not isinstance(p, DTensor)], pstate.group(kind))
    if len(pstate.ranks("embedding")) > 1:
        _all_reduce_flat([local(p.grad) for p in params if p.shared_embedding], pstate.group("embedding"))


def grad_norm(params: list, pstate: ParallelState) -> torch.Tensor:
    """Global L2 norm of the gradient, each distinct parameter counted once (fp64 sum)."""
    terms = []
    for p in params:
        if p.shared_embedding and not pstate.is_first_stage:
            continue  # the last stage's copy of the embedding
        if isinstance(p, DTensor):
            owner = True  # a shard: every rank holds a different part
        else:
            owner = pstate.dp_rank == 0 if p.replicated_over == "dp" else pstate.expert_dp_rank == 0
        if owner and p.grad is not None:
            terms.append(local(p.grad).detach().double().pow(2).sum())
    device = params[0].device if params else torch.device("cpu")
    # one sum on one device (offloaded shards may sit on the host), no per-tensor sync
    sq = torch.stack([t.to(device) for t in terms]).sum() if terms else \
        torch.zeros((), dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    return sq.sqrt()


def clip_gradients(params: list, max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """Scale all gradients by ``min(1, max_norm / norm)``; returns the factor used."""
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            local(p.grad).mul_(factor.to(p.grad.device, p.grad.dtype))
    return factor


def reduce_step_loss(loss_sum: torch.Tensor, num_tokens: torch.Tensor, extra: list | tuple = (),
                     num_extra: int = 0) -> tuple[float, int, list]:
    """Global per-token loss of the step on every rank (non-last stages contribute zeros), plus
    ``num_extra`` more sums (e.g. MTP depths) per main-head token. One all-reduce; every rank
    must call it with the same ``num_extra``."""
    t = torch.zeros(2 + num_extra, dtype=torch.float64)
    t[0], t[1] = loss_sum.double(), num_tokens.double()
    for i, x in enumerate(extra):
        t[2 + i] = float(x)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    n = t[1].clamp(min=1)
    return float(t[0] / n), int(t[1]), [float(x / n) for x in t[2:]]

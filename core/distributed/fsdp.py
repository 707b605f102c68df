"""FSDP2 for pipeline stages: dense parameters sharded over the data-parallel ranks, expert
parameters over the expert-data-parallel ranks, optional CPU offload, and bf16 mixed precision
over fp32 master parameters (also without sharding, on one-rank meshes).

The model names its units (``fsdp_units()``, innermost first, each with the replication group
of its parameters): units over ``"dp"`` shard on the data-parallel mesh, units over
``"expert_dp"`` (routed experts) on the expert-data-parallel mesh; the chunk's remaining
parameters (for a decoder: embedding, final norm, heads) form the root unit. Gradients are
*summed* across replicas (divide factor 1), because the loss is already normalised by the
step's global token count. Where expert-DP is 1 each EP rank owns its
experts whole: they are left out of FSDP (``ignored_params``), or, when offloading, put on a
one-rank mesh so FSDP moves them between host and device.

With a pipeline, ``PipelineExecutor`` turns gradient reduction off for every backward of a
chunk but its last one in the step, so FSDP reduce-scatters once per step (every backward
under ``--cpu-offload optimizer``, see ``apply_fsdp``). What is sharded, offloaded and gathered
when is the memory mode's placement (``core/memory_mode.py``), which the planner books too.

Backward prefetch: FSDP2 prefetches, at a unit's pre-backward, the unit whose forward ended just
before its own (the reverse of the recorded post-forward order). A block run in chunks
(``--recompute-chunks``, ``core/transformer/chunked.py``) records its inner units' forwards once
per chunk, so that order points inside the block and the block before it is gathered only when
its own backward starts. Such blocks get an explicit order instead
(:func:`backward_prefetch_order`, FSDP2's public ``set_modules_to_backward_prefetch``).
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from core.memory_mode import Placement
from core.model_api import iter_params
from core.parallel_state import ParallelState

def _policy(on: bool, pin: bool = True) -> OffloadPolicy:
    # pinned host memory only helps (and only exists) with an accelerator
    return CPUOffloadPolicy(pin_memory=pin and torch.cuda.is_available()) if on else OffloadPolicy()


def _self_mesh(ps: ParallelState, device_type: str) -> DeviceMesh:
    return ps.mesh("self", device_type)


def apply_fsdp(chunk: torch.nn.Module, ps: ParallelState, placement: Placement, device_type: str = "cpu") -> bool:
    """Wrap ``chunk``'s units with FSDP2 in place as ``placement`` says
    (``core/memory_mode.MemoryMode.placement``); returns False when there is nothing to do.

    Sharded (``placement.shard``): dense parameters over DP x CP, experts over expert-DP.
    ``bf16``: mixed precision: the parameters stay fp32 (the master weights the optimizer
    updates and checkpoints store), each unit computes with a bf16 copy, and gradients are
    accumulated across micro-batches and reduced in fp32; units the model marks ``fp32``
    (routers) compute in fp32. Without sharding every unit sits on a one-rank mesh, so FSDP
    only provides that mixed precision (or the offload): replicas still sum gradients in
    ``sync_gradients``.
    ``gather_once``: keep each unit's gathered parameters from its first forward of the step
    until ``reshard(chunks)`` after the optimizer step (one all-gather per step instead of one
    per micro-batch and pass, for the memory of a whole unsharded stage); always so on a
    one-rank mesh, where gathering is a bf16 cast.
    ``--cpu-offload optimizer`` (``sync_every_microbatch``): every unit offloaded (fp32 masters,
    their gradients and the optimizer state in host memory) but gathered once per step, so the
    compute copies (bf16 under ``bf16``) stay resident on the device from the first forward to
    the optimizer step: one host-to-device copy of the shards per step instead of one per
    micro-batch and pass; and every backward reduce-scatters (``set_gradient_sync``), so each
    micro-batch's fp32 gradient shards go to the host and accumulate there instead of the stage's
    unsharded gradients accumulating on the device for the whole step. Pinned host memory comes
    from a caching allocator that rounds each block up to a power of two (a 755 MB expert stack
    takes 1 GiB): worth it where weights cross PCIe per micro-batch, not for those once-per-step
    copies, whose host footprint must stay as planned (``pin_offloaded``)."""
    pl = placement
    if not pl.wraps:
        return False
    expert_managed = pl.roles["expert"].managed
    if pl.shard:
        dp_mesh = ps.mesh("dp_cp", device_type)
        if ps.sizes.expert_dp > 1:
            edp_mesh = ps.mesh("expert_dp", device_type)
        elif expert_managed:  # experts whole on each EP rank: a one-rank mesh
            edp_mesh = _self_mesh(ps, device_type)
        else:
            edp_mesh = None
    else:
        dp_mesh = edp_mesh = _self_mesh(ps, device_type)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if pl.bf16 \
        else MixedPrecisionPolicy()
    full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    experts = {p for _, _, p, spec in iter_params([chunk]) if spec.replicated_over == "expert_dp"}
    ignored = experts if edp_mesh is None else None
    for unit in chunk.fsdp_units():
        if unit.fp32 and not pl.bf16:
            continue  # its own unit only to keep its precision
        kind = "expert" if unit.replicated_over == "expert_dp" else "dense"
        if kind == "expert" and edp_mesh is None:
            continue
        fully_shard(unit.module, mesh=edp_mesh if kind == "expert" else dp_mesh,
                    offload_policy=_policy(pl.roles[kind].offloaded, pl.pin_offloaded),
                    mp_policy=full if unit.fp32 else mixed, ignored_params=None if kind == "expert" else ignored,
                    reshard_after_forward=not pl.gather_once)
    # the root unit (embedding, final norm, heads) stays gathered from forward to backward: its
    # backward follows at once, and the chunked loss's op saved the gathered head weight
    # (torch 2.11 freed it when the root was told to reshard; 2.13 keeps it either way)
    fully_shard(chunk, mesh=dp_mesh, offload_policy=_policy(pl.roles["dense"].offloaded, pl.pin_offloaded),
                mp_policy=mixed, ignored_params=ignored, reshard_after_forward=False)
    chunk.reduce_every_backward = pl.sync_every_microbatch
    # the root's weights (embedding, final norm, heads) are last read by the heads' backward; with
    # one stage per rank no later micro-batch's forward has saved them, so they are freed then
    # rather than after the whole backward
    if pl.gather_per_microbatch and ps.sizes.pp == 1:
        ReleaseRootAfterHeads.attach(chunk)
    for unit, targets in backward_prefetch_order(chunk):
        unit.set_modules_to_backward_prefetch(targets)
    for m in chunk.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
            if pl.gather_once:
                m.set_reshard_after_backward(False)
    return True


def backward_prefetch_order(chunk: torch.nn.Module, is_unit=None) -> list:
    """``[(block, units it prefetches in its backward)]`` for each block of the chunk run in chunks
    that is an FSDP unit (``is_unit``, by default: an ``FSDPModule``): its inner units in forward
    order (the block's backward starts by rerunning its first chunk, which needs them), then the
    block before it (gathered while this one runs its chunks, as FSDP's default gathers the
    previous block during an unchunked block's backward)."""
    is_unit = is_unit or (lambda m: isinstance(m, FSDPModule))
    blocks = [b for _, b in chunk.blocks()]
    out = []
    for i, block in enumerate(blocks):
        rc = getattr(block, "recompute_placement", None)  # core/transformer/block.apply_recompute's
        if rc is None or not (rc.full and rc.chunked) or not is_unit(block):
            continue
        inner = [m for m in block.modules() if m is not block and is_unit(m)]
        before = [blocks[i - 1]] if i > 0 and is_unit(blocks[i - 1]) else []
        out.append((block, inner + before))
    return out


class ReleaseRootAfterHeads:
    """A forward hook on the chunk's last decoder layer (``blocks()``, the last id >= 0), whose
    output is all the heads read of the trunk (``core/model_api.py``): on a forward that will run a
    backward it hooks that output's gradient, which is whole once every head's backward (main
    head and extra blocks) has run, and then calls ``release`` (the root's ``reshard``)."""

    def __init__(self, release):
        self.release = release

    @classmethod
    def attach(cls, chunk: torch.nn.Module) -> "ReleaseRootAfterHeads | None":
        layers = [m for i, m in chunk.blocks() if i >= 0]
        if not layers:
            return None
        hook = cls(chunk.reshard)
        layers[-1].register_forward_hook(hook)
        return hook

    def __call__(self, module, args, output) -> None:
        h = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and h.requires_grad:
            h.register_hook(self._heads_done)

    def _heads_done(self, grad) -> None:
        self.release()


def reshard(chunks) -> None:
    """Free gathered parameters (after the optimizer step, which updated the shards); a no-op
    for units that are not gathered."""
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def set_gradient_sync(chunk: torch.nn.Module, enabled: bool) -> None:
    """Accumulate unsharded gradients locally (False) or reduce-scatter on this backward (True).
    Under ``--cpu-offload optimizer`` every backward reduces: the fp32 gradient shards then
    accumulate on the host and no unit's unsharded gradient outlives its own backward."""
    if isinstance(chunk, FSDPModule):
        chunk.set_requires_gradient_sync(enabled or getattr(chunk, "reduce_every_backward", False))

"""Turning a chunk built on the ``meta`` device into real tensors: only what this process holds,
each tensor written once, from its seed (a checkpoint may fill them instead:
``training/startup.py``).

Initial values. A parameter is a stack along dim 0 of *blocks*, each drawn from its own generator
seeded by the tensor's global name: one block per expert for stacked expert weights (key
``name#<global expert>``), otherwise row blocks of at most ``INIT_BLOCK_NUMEL`` elements (key
``name``, or ``name@<block>`` when there are several). Block shapes depend only on the global
tensor, so a process that holds rows ``[a, b)`` (an expert-parallel slice, an FSDP dim-0 shard)
draws only the blocks that overlap them and gets exactly the rows one process would have: every
PP / EP / DP / FSDP layout starts from the same weights. A module may give some of its
parameters a constant instead (``constant_init()``: an RMSNorm's 0 for ``1 + w``, 1 for plain
``w``); buffers are set by their module's ``reset_buffers()`` (RoPE frequencies recomputed in
fp32, a router's balancing bias zeroed).

Generator. Blocks are drawn on the rank's compute device (``generator_device``): the CUDA Philox
generator fills a rank's share of a large model (billions of values) in well under a second,
where the CPU's Mersenne Twister draws ~250 M values/s per core, tens of seconds per rank. The
price: a GPU run starts from other weights than a CPU run with the same seed (and GPU models
with different SM counts differ too); layouts on the same kind of device always agree. CPU runs,
and so the tests, use the CPU generator and are deterministic. Pass ``generator_device="cpu"`` to
get the CPU's values on a GPU (each block is then copied over).
"""
from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

INIT_BLOCK_NUMEL = 1 << 22  # 16 MiB of fp32: the largest temporary an initialisation needs


def local_rows(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(the tensor this process holds, its first row in the global tensor)``: the whole tensor,
    or an FSDP2 dim-0 shard (rows split like ``torch.chunk``: ``ceil(n / world)`` per rank, the
    last ones shorter or empty)."""
    if not isinstance(p, DTensor):
        return p.detach(), 0
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise ValueError(f"only dim-0 shards on a 1-D mesh are supported, got {p.placements} "
                         f"on a {p.device_mesh.ndim}-D mesh")
    local = p.to_local()
    n, world = p.shape[0], p.device_mesh.size()
    step = -(-n // world)
    start = min(n, p.device_mesh.get_local_rank() * step)
    if local.shape[0] != max(0, min(step, n - start)):
        raise ValueError(f"a shard of {local.shape[0]} rows at row {start} of {n} is not how FSDP2 "
                         f"splits dim 0 over {world} ranks")
    return local, start


def seeded_normal(shape, std: float, seed: int, key: str, device=None) -> torch.Tensor:
    """Normal(0, std) values of one block, from a generator seeded by ``key`` and ``seed``."""
    device = torch.device(device or "cpu")
    g = torch.Generator(device=device).manual_seed((zlib.crc32(key.encode()) << 20) ^ seed)
    return torch.randn(shape, generator=g, device=device).mul_(std)


def fill_seeded(out: torch.Tensor, name: str, shape, first_row: int, std: float, seed: int,
                expert_offset: int | None = None, device=None) -> None:
    """Write rows ``[first_row, first_row + len(out))`` of the global tensor ``name`` (``shape``)
    into ``out``; ``expert_offset``: dim 0 stacks experts, the first being this global index."""
    shape = tuple(shape)
    if out.dim() == 0:
        out.copy_(seeded_normal((), std, seed, name, device))
        return
    n = out.shape[0]
    if expert_offset is not None:
        for i in range(n):
            out[i].copy_(seeded_normal(shape[1:], std, seed, f"{name}#{expert_offset + first_row + i}", device))
        return
    per_row = max(1, math.prod(shape[1:]))
    rows = max(1, INIT_BLOCK_NUMEL // per_row)
    several = shape[0] > rows
    for b in range(first_row // rows, -(-(first_row + n) // rows)):
        lo, hi = b * rows, min(shape[0], (b + 1) * rows)
        block = seeded_normal((hi - lo, *shape[1:]), std, seed, f"{name}@{b}" if several else name, device)
        a, z = max(lo, first_row), min(hi, first_row + n)
        out[a - first_row:z - first_row].copy_(block[a - lo:z - lo])


def constant_values(model: nn.Module) -> dict[str, float]:
    """Parameters whose modules give them a constant initial value (``constant_init()``)."""
    out = {}
    for prefix, m in model.named_modules():
        init = getattr(m, "constant_init", None)
        if callable(init):
            out.update({f"{prefix}.{n}" if prefix else n: v for n, v in init().items()})
    return out


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, std: float, *, generator_device=None, skip=(),
                    masters=None) -> None:
    """Seeded initial values (normal, ``std``) for every parameter of ``model`` but those named
    in ``skip`` and those with a constant, each process writing only the rows it holds (see the
    module docstring). ``model`` implements ``param_specs()`` (``core/model_api.py``).
    ``masters`` (``core/optim/masters.py``): parameters it holds get their fp32 value as bf16
    plus remainder (drawn in fp32 as always, so every storage mode starts from one master)."""
    specs, constants = model.param_specs(), constant_values(model)
    for name, p in model.named_parameters():
        local, first = local_rows(p)
        if name in skip or local.is_meta or local.numel() == 0:
            continue
        out = torch.empty_like(local, dtype=torch.float32) if masters is not None and p in masters else local
        if name in constants:
            out.fill_(constants[name])
        else:
            fill_seeded(out, name, p.shape, first, std, seed, specs[name].expert_offset,
                        generator_device or local.device)
        if out is not local:
            masters.set_master(p, out)


@torch.no_grad()
def init_buffers(model: nn.Module, device) -> None:
    """Every buffer from its module's ``reset_buffers(device)`` (``to_empty`` leaves them
    undefined); a buffer whose module has none is an error naming it."""
    for prefix, m in model.named_modules():
        own = [n for n, b in m.named_buffers(recurse=False) if b is not None]
        if not own:
            continue
        reset = getattr(m, "reset_buffers", None)
        if not callable(reset):
            raise ValueError(f"buffer {(prefix + '.' if prefix else '') + own[0]!r}: no initial value is "
                             f"known for it; give {type(m).__name__} a reset_buffers(device) method")
        reset(device)


def host_parameters(model: nn.Module) -> set[int]:
    """Ids of the parameters FSDP keeps in host memory (CPU offload; FSDP2 records the policy
    only on its parameter groups: ``core/distributed/fsdp_internals.py``)."""
    from torch.distributed.fsdp import FSDPModule

    from core.distributed.fsdp_internals import offloaded_shards

    return {id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in offloaded_shards(m)}


def allocate(model: nn.Module, device) -> None:
    """Real (undefined) storage for every meta tensor of ``model``: offloaded FSDP shards in host
    memory, everything else on ``device``. Only this process's shards are allocated."""
    device, host = torch.device(device), host_parameters(model)
    for prefix, m in model.named_modules():
        own = list(m.parameters(recurse=False))
        places = {id(p) in host for p in own}
        if len(places) > 1:
            raise ValueError(f"module {prefix or '<chunk>'}: some parameters offloaded, others not")
        target = torch.device("cpu") if places == {True} else device
        if any(isinstance(p, DTensor) for p in own) or not own:  # FSDP's shards: its own _apply
            m.to_empty(device=target, recurse=False)
        else:  # plain tensors: a new Parameter of the same name (``to_empty`` would swap the
            # tensors, which torch refuses for the memory trace's fake tensors: the fake mode
            # holds a weak reference to each it has seen)
            for name, p in list(m.named_parameters(recurse=False)):
                m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=target),
                                                   requires_grad=p.requires_grad)
            for name, b in m.named_buffers(recurse=False):
                if b is not None:
                    m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=target)


def materialize_seeded(model: nn.Module, device, *, seed: int, std: float, init: bool = True,
                       generator_device=None) -> None:
    """Allocate ``model`` (built on meta, possibly FSDP-wrapped) on ``device``, set its buffers
    and, with ``init``, its parameters from ``seed`` (``init=False`` leaves them undefined)."""
    allocate(model, device)
    init_buffers(model, device)
    if init:
        init_parameters(model, seed, std, generator_device=generator_device or device)


def shard_bytes(chunks) -> dict:
    """Bytes of parameters and buffers this process holds: ``{"device": ..., "host": ...}``."""
    out = {"device": 0, "host": 0}
    for chunk in chunks:
        for t in list(chunk.parameters()) + list(chunk.buffers()):
            local, _ = local_rows(t)
            out["host" if local.device.type == "cpu" else "device"] += local.numel() * local.element_size()
    return out

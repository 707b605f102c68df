"""Exact fp32 master weights in 4 bytes per parameter: the bf16 compute value plus a 16-bit
remainder (``--store-param-remainders``; Transformer Engine's ``store_param_remainders``).

An fp32 value is 32 bits: on a little-endian machine its low 16 bits come first, then the 16 bits
a truncation to bf16 would keep. ``split`` keeps the low half as the remainder, bit for bit, and
rounds the high half to nearest: up by one when the low half is >= 0x8000 (its top bit set, i.e.
negative as an int16), which moves away from zero in sign-magnitude. ``join`` undoes it: one less
on the high half when the remainder is negative, then the two halves side by side. Both are a
handful of int16 operations on views, with no wider temporaries, and the round trip is exact for
every bit pattern (zeros of either sign, subnormals, infinities, NaNs: the arithmetic wraps).

The rounding is to nearest with ties away from zero, not to even: no 16-bit remainder can make
round-to-even exact (an even bf16 value is the nearest of 65,537 fp32 values, both ties
included, one more than 16 bits tell apart). So the compute value equals ``x.to(torch.bfloat16)``
except where ``x`` sits exactly halfway between two bf16 values and round-to-even would go down
(2^-17 of values), where it is the other neighbour, one bf16 ulp away; a value above the largest
finite bf16 by more than half an ulp computes as infinity, as ``.to(torch.bfloat16)`` does.

| mode | on the device, per parameter |
| --- | --- |
| ``--bf16`` (FSDP2 mixed precision) | 4 fp32 master + 2 bf16 compute copy while gathered |
| ``--bf16 --store-param-remainders`` | 2 bf16 weight (the compute value itself) + 2 remainder |

The optimizer joins one parameter at a time into an fp32 temporary, updates it in fp32 and
splits it back (:meth:`RemainderMasters.fp32`), so at most one tensor's fp32 copy exists at once.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from core.distributed.grads import local


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low 16 bits, high 16 bits) of an fp32 tensor, as int16 views (little-endian)."""
    pairs = x.contiguous().view(torch.int16).view(*x.shape, 2)
    return pairs[..., 0], pairs[..., 1]


def split(x: torch.Tensor, out_hi: torch.Tensor | None = None,
          out_rem: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` -> (bf16 compute value rounded to nearest, int16 remainder); written into
    ``out_hi`` / ``out_rem`` when given (any layout of ``x``'s shape)."""
    if x.dtype != torch.float32:
        raise TypeError(f"split takes fp32 masters, got {x.dtype}")
    low, high = _halves(x)
    hi = high + (low < 0).to(torch.int16)  # round half away from zero; int16 wraps
    hi = hi.view(torch.bfloat16)
    if out_hi is None:
        return hi, low.clone()
    out_hi.copy_(hi)
    out_rem.copy_(low)
    return out_hi, out_rem


def join(hi: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """(bf16, int16 remainder) -> the fp32 master they were split from, bit for bit."""
    if hi.dtype != torch.bfloat16 or rem.dtype != torch.int16:
        raise TypeError(f"join takes bf16 and int16, got {hi.dtype} and {rem.dtype}")
    high = hi.contiguous().view(torch.int16) - (rem < 0).to(torch.int16)
    return torch.stack([rem, high], dim=-1).view(torch.float32).squeeze(-1)


class RemainderMasters:
    """The int16 remainders of a model's bf16 parameters (this rank's shards), keyed by the
    parameter; ``fp32(p)`` gives the exact fp32 master of ``p`` for an update and writes the
    result back into ``p``'s own storage and its remainder.

    The interface every master storage gives the optimizers (``HostMasters`` too):
    ``update(p, fn, *inputs)`` runs ``fn(master, *inputs)`` on ``p``'s fp32 master, with the
    inputs (an update, a gradient) on the master's device; ``state_device(p)`` is where the
    optimizer state of ``p`` lives; ``finish()`` waits for every update and makes the compute
    values current (a no-op here: updates are synchronous)."""

    def __init__(self, params=()):
        self.rem = {}
        self.add(params)

    def add(self, params) -> None:
        for p in params:
            if p.dtype == torch.bfloat16:
                self.rem[p] = torch.zeros_like(local(p), dtype=torch.int16)

    def __contains__(self, p) -> bool:
        return p in self.rem

    def bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.rem.values())

    def master(self, p) -> torch.Tensor:
        """This rank's fp32 master of ``p`` (a new tensor)."""
        return join(local(p).detach(), self.rem[p]) if p in self.rem else local(p).detach().float()

    @torch.no_grad()
    def set_master(self, p, value: torch.Tensor) -> None:
        """Store ``value`` (fp32, this rank's rows) as ``p``'s master: its bf16 and remainder."""
        if p in self.rem:
            split(value.float(), local(p), self.rem[p])
        else:
            local(p).copy_(value)

    @contextmanager
    def fp32(self, p):
        """``with masters.fp32(p) as m:`` update ``m`` (fp32, this rank's rows) in place: a joined
        temporary for a bf16 parameter, the parameter's own storage for an fp32 one."""
        if p not in self.rem:
            yield local(p)
            return
        m = self.master(p)
        yield m
        self.set_master(p, m)

    def update(self, p, fn, *inputs) -> None:
        with self.fp32(p) as m:
            fn(m, *[x.to(m.device) for x in inputs])

    def state_device(self, p) -> torch.device:
        return local(p).device

    def finish(self) -> None:
        """Every update is synchronous here."""


NO_MASTERS = RemainderMasters(())  # fp32 parameters: their storage is the master


def to_bf16_storage(chunk: torch.nn.Module) -> int:
    """On the meta device, before FSDP: every parameter that computes in bf16 (all but those of
    units the model keeps in fp32, the routers) becomes a bf16 parameter, the compute value its
    remainder completes. Returns how many."""
    keep = {id(p) for u in chunk.fsdp_units() if u.fp32 for p in u.module.parameters()}
    n = 0
    for p in chunk.parameters():
        if p.is_floating_point() and id(p) not in keep and p.dtype == torch.float32:
            p.data = p.data.to(torch.bfloat16)
            n += 1
    return n


def attach(chunk: torch.nn.Module, masters) -> None:
    """Give ``chunk`` its rank's master storage (one object for all of a rank's chunks)."""
    chunk._param_masters = masters


def masters_of(chunks):
    """The master storage of a rank's chunks (``NO_MASTERS`` when their parameters are their
    own fp32 masters)."""
    found = {id(m): m for m in (getattr(c, "_param_masters", None) for c in chunks) if m is not None}
    if len(found) > 1:
        raise ValueError("a rank's chunks must share one master storage")
    return next(iter(found.values()), NO_MASTERS)

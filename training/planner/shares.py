"""What each rank of a layout holds and when its pipeline runs what, for the planners: each
pipeline rank's share of the model built on the meta device (nothing allocated) and summarised
as tensors (shape, role, which block they belong to), and the schedule's facts (peak in-flight
micro-batches, live p2p buffers, the executor's programs).

Both are cached: a share depends only on (model, pp, vpp, ep, layout, seq_length) and the
schedule facts only on (pp, vpp, micro-batches), so the search over memory modes, recompute
and micro-batch sizes (``training/planner/search.py``) builds each once and derives the rest with
arithmetic (``memory.py``, ``timing.py``). EP ranks of one pipeline rank hold shares of
the same shapes (the experts split evenly), so one build per pipeline rank stands for all.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from core.finetune.lora import LoraSettings, apply_lora
from core.model_api import ParamSpec
from core.parallel_state import ParallelSizes, ParallelState
from core.pipeline.p2p import max_live_buffers, plan_all
from core.pipeline.schedules import build_schedule
from core.pipeline.simulate import simulate
from training.parallelize import build_chunks

ROOT = None  # block of the embedding, final norm and heads (FSDP's root unit)


@dataclass(frozen=True, eq=False)  # hashed by identity (cached tallies)
class TensorShare:
    """One parameter of a rank's share: ``t`` is its meta tensor (whole on this EP rank, before
    any FSDP sharding); ``block``: its decoder layer's global index, ``-1 - k`` for extra block
    ``k`` (an MTP depth), or ``ROOT``."""

    t: torch.Tensor
    spec: ParamSpec
    block: int | None
    fp32: bool = False  # in an FSDP unit that computes in fp32 under bf16 (a router)
    frozen: bool = False  # a LoRA run's frozen base: no gradient, master or optimizer state

    @property
    def expert(self) -> bool:
        return self.spec.replicated_over == "expert_dp"


@dataclass(frozen=True, eq=False)
class ChunkShare:
    """One virtual stage on one rank."""

    stage: int           # virtual stage index (chunk * pp + pp_rank)
    first: bool          # holds the embedding
    last: bool           # holds the final norm, head and extra (MTP) blocks
    layers: tuple        # global decoder-layer indices, in order
    tensors: tuple       # TensorShare, every parameter of the chunk


def _summarise(chunk, stage: int) -> ChunkShare:
    block_of = {}
    for i, block in chunk.blocks():
        block_of.update({id(p): i for p in block.parameters()})
    fp32 = {id(p) for u in chunk.fsdp_units() if u.fp32 for p in u.module.parameters()}
    specs = chunk.param_specs()
    # an image encoder the chunk holds is booked from its shape by the planner (planner/vision.py)
    parts = chunk.param_parts() if hasattr(chunk, "param_parts") else {}
    encoder = set(parts.get("vision", ())) | set(parts.get("projector", ()))
    tensors = tuple(TensorShare(p, specs[name], block_of.get(id(p), ROOT), id(p) in fp32, not p.requires_grad)
                    for name, p in chunk.named_parameters() if name not in encoder)
    return ChunkShare(stage, chunk.first, chunk.last, tuple(i for i, _ in chunk.blocks() if i >= 0), tensors)


@lru_cache(maxsize=None)
def kind_block_numel(chunk: ChunkShare, expert: bool) -> dict:
    """``block_numel`` of the chunk's expert parameters, or of the others (read it, do not change it)."""
    out: dict = {}
    for s in chunk.tensors:
        if s.expert == expert:
            out[s.block] = out.get(s.block, 0) + s.t.numel()
    return out


@lru_cache(maxsize=None)
def block_numel(chunk: ChunkShare) -> dict:
    """Parameters per FSDP block (decoder layer or extra block; ``ROOT`` for the rest)."""
    out: dict = {}
    for s in chunk.tensors:
        out[s.block] = out.get(s.block, 0) + s.t.numel()
    return out


_SHARES: dict = {}


def rank_shares(cfg, pp: int, vpp: int, ep: int, layout: str | None,
                seq_length: int, lora: tuple = ()) -> list[list[ChunkShare]]:
    """Per pipeline rank, its chunks' shares (EP rank 0's; every EP rank's have these shapes);
    ``lora``: ``(rank, targets)`` of a LoRA run (``core/finetune/lora.py``: adapters added, the base frozen)."""
    key = (type(cfg).__name__, repr(cfg), pp, vpp, ep, layout, seq_length, lora)
    if key not in _SHARES:
        sizes = ParallelSizes(pp * ep, pp=pp, ep=ep, vpp=vpp)  # dp = ep: the share ignores expert-DP
        out = []
        for r in range(pp):
            state = ParallelState(sizes, sizes.rank_of(dp=0, pp=r), {})
            chunks = build_chunks(cfg, state, layout, seq_length=seq_length, device="meta")
            for c in chunks if lora else ():
                apply_lora(c, LoraSettings(lora_rank=lora[0], lora_targets=lora[1]))
            out.append([_summarise(c, k * pp + r) for k, c in enumerate(chunks)])
        _SHARES[key] = out
    return _SHARES[key]


@dataclass(frozen=True)
class ScheduleFacts:
    schedule: list          # action lists per pipeline rank
    programs: dict          # the executor's programs (actions and p2p batches), pp > 1
    peak_in_flight: list    # most micro-batches forwarded and not yet backwarded, per rank
    p2p_buffers: list       # most [T, hidden] p2p buffers live at once, per rank


@lru_cache(maxsize=256)
def schedule_facts(pp: int, vpp: int, num_microbatches: int) -> ScheduleFacts:
    schedule = build_schedule(pp, vpp, num_microbatches)
    sim = simulate(schedule)
    programs = plan_all(schedule) if pp > 1 else {}
    buffers = [max_live_buffers(programs[r], r, pp, pp * vpp, inputs=False) if pp > 1 else 0
               for r in range(pp)]
    return ScheduleFacts(schedule, programs, sim.peak_in_flight, buffers)

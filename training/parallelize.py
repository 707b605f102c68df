"""Parallelism applied to a registered model's chunks from outside: ``parallelize`` is the only
place that does it, in this order (each step needs the one before it):

1. pipeline split (``build_chunks``) on the ``meta`` device: this rank's ``vpp`` chunks of
   ``stage_layers`` (first stage: embedding; last: final norm, head and the extra blocks; layers
   split by cost unless ``--pipeline-layout`` says otherwise), each holding only its EP rank's
   experts, with shapes but no storage yet;
2. expert parallelism (``core.moe.parallel.apply_expert_parallel``): MoE layers route through the
   all-to-all (or all-gather) dispatcher over the EP group, so the experts see only their own
   tokens; with ``--overlap-moe-expert-parallel-comm`` their blocks run the two-chunk schedule
   that hides those all-to-alls behind compute (``core.moe.overlap.apply_moe_overlap``);
3. context parallelism (``core.context_parallel.apply``): attention modules attend across the
   CP group (all-gathered K/V on full layers, a halo on sliding ones) and routers sum their load
   statistics over it; the data are the loader's shards (``data/cp_shard.py``);
4. LoRA (``core.finetune.lora.apply_lora``, with ``--lora-rank``): the chosen projections get adapters
   (routed experts grouped ones, in the expert module, so they hold this EP rank's experts only)
   and every other parameter is frozen, before FSDP wraps them; under ``--bf16`` the frozen base
   is stored in bf16 (``frozen_to_bf16``: no fp32 master, it is never updated); ``--freeze-*``
   freezes whole parts the same way (``core/finetune/freeze.py``);
5. activation recompute (``core.transformer.block.apply_recompute``): a flag on the layers, read
   by their forward;
6. FSDP and mixed precision (``core.distributed.fsdp.apply_fsdp``) as the memory mode's placement
   says (``core/memory_mode.py``: the same placement the planner books), still on meta (with
   ``--store-param-remainders`` the parameters are bf16 already, ``core/optim/masters.py``): each unit's
   parameters become DTensor shards (dense over DP, experts over expert-DP). ``--bf16``
   without sharding still goes through FSDP2, on one-rank meshes, for its mixed precision:
   bf16 compute copies, fp32 gradient accumulation and reduction, fp32 routers; then
   ``--compile`` (``core/compile.py``): the blocks' ``forward`` methods, so FSDP's hooks stay
   outside the graphs (and it sees which blocks hold FSDP units of their own);
7. materialisation (``training/startup.py``): storage for this rank's shards only, on its device
   (offloaded shards in host memory), in fp32 (the master weights; or bf16 plus a 16-bit
   remainder per parameter, the same fp32 master bit for bit); then each tensor written
   once: ``--load-hf`` streamed into the shards row block by row block through the family's
   weight adapter, or seeded initial values that are the same in any layout. When the trainer
   will resume from ``--load`` (``from_checkpoint``) neither happens: the checkpoint fills every
   parameter, and the HF checkpoint is never read.

Nothing here knows a family: the registry (``models/registry.py``) builds the chunks and gives
the shapes the stage split is costed by.
"""
from __future__ import annotations

import torch

from core.compile import apply_compile
from core.context_parallel.apply import apply_context_parallel, cp_comm
from core.distributed.fsdp import apply_fsdp
from core.finetune.freeze import freeze_parts
from core.finetune.lora import LoraSettings, apply_lora, frozen_to_bf16
from core.costs.flops import balanced_layout
from core.moe.overlap import apply_moe_overlap
from core.moe.parallel import apply_expert_parallel
from core.optim.host_masters import HostMasters
from core.optim.masters import RemainderMasters, to_bf16_storage
from core.parallel_state import ParallelState, local_device
from core.transformer.block import apply_recompute
from core.transformer.chunked import ChunkedRecompute
from models.registry import shapes_of, spec_of
from training.startup import materialize


def parallelize(config, ps: ParallelState, args, *, from_checkpoint: bool = False) -> list:
    """This rank's model chunks with every parallelism applied. ``args``: the parsed training
    flags (``train_args.parse``): sections ``parallel``, ``memory``, ``model``, ``schedule``.
    ``from_checkpoint``: a ``--load`` checkpoint will fill the parameters (no initialisation,
    no ``--load-hf`` read)."""
    m, mem, d = args.model, args.memory, args.data
    num_microbatches = d.global_batch_size // (d.micro_batch_size * ps.sizes.dp)
    lora = getattr(args, "lora", None) or LoraSettings()
    placement = mem.placement(ps.sizes, num_microbatches, lora=lora.enabled)  # core/memory_mode.py
    chunks = build_chunks(config, ps, args.parallel.pipeline_layout, seq_length=args.data.seq_length,
                          device="meta")
    device = local_device()
    # one master storage for the rank: bf16 + remainder, or fp32 in host memory
    # (host masters: update workers x intra-op threads sized to the rank's cores, set by the entry point)
    masters = RemainderMasters() if placement.remainders else \
        HostMasters(cores=torch.get_num_threads()) if placement.host_masters else None
    comm = cp_comm(ps) if ps.sizes.cp > 1 else None
    chunked = ChunkedRecompute()  # the rank's offload stream and pending gradients (--recompute-chunks)
    for chunk in chunks:
        if masters is not None:  # bf16 parameters; their fp32 masters come at materialisation
            to_bf16_storage(chunk)
        if ps.sizes.ep > 1:
            apply_expert_parallel(chunk, ps, m.moe_dispatcher)
            if args.parallel.overlap_moe_expert_parallel_comm:  # core/moe/overlap.py
                apply_moe_overlap(chunk)
        if comm is not None:
            apply_context_parallel(chunk, comm)
        apply_lora(chunk, lora)
        freeze_parts(chunk, m.frozen_parts)
        if (lora.enabled or m.frozen_parts) and placement.bf16:  # a stage may hold no adapter: still frozen
            frozen_to_bf16(chunk)  # a frozen parameter's one copy is its bf16 compute weight
        apply_recompute(chunk, placement.recompute_placement, shared=chunked)
        apply_fsdp(chunk, ps, placement, device.type)
        if m.compile:
            apply_compile(chunk, m.compile_backend)
        fill = not from_checkpoint or lora.enabled  # a LoRA checkpoint holds the adapters only
        materialize(chunk, device, seed=args.schedule.seed, init=fill,
                    hf_path=m.load_hf if fill else None, progress=ps.rank == 0, masters=masters)
    if isinstance(masters, HostMasters):
        masters.pin()  # the staging slab: one pinned allocation, timed for the start-up log
    return chunks


def even_layout(num_layers: int, num_stages: int) -> list[int]:
    """Equal layer counts per stage, the remainder in the middle stages (ignores what the first
    and last stage carry besides their layers)."""
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    first_extra = (num_stages - extra) // 2
    return [base + (first_extra <= s < first_extra + extra) for s in range(num_stages)]


def stage_layers(config, num_stages: int, layout: str | None = None, seq_length: int = 4096) -> list[range]:
    """Contiguous layer ranges per virtual stage. ``layout``: comma-separated layer counts
    (``--pipeline-layout``, e.g. ``"14,14,14,3"``), which wins; by default the split that
    minimises the slowest stage under the FLOP model of ``core/costs/flops.py`` at ``seq_length`` (the
    last stage also runs the head and the extra blocks, so it gets fewer layers)."""
    L = config.num_layers
    if layout:
        counts = [int(x) for x in layout.split(",")]
        if len(counts) != num_stages or sum(counts) != L or min(counts) < 1:
            raise ValueError(f"--pipeline-layout {layout!r}: need {num_stages} positive counts "
                             f"summing to {L}")
    else:
        counts = balanced_layout(shapes_of(config), num_stages, seq_length)
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def build_chunks(config, pstate: ParallelState, layout: str | None = None, *, seq_length: int = 4096,
                 seed: int = 0, device="cpu") -> list:
    """This rank's pipeline chunks (virtual stage ``c * pp + pp_rank`` for chunk ``c``), with
    its EP rank's share of the experts, initialised from ``seed`` on ``device`` (on ``meta``:
    shapes only, for ``parallelize`` and the memory planner)."""
    spec = spec_of(config)
    pp, vpp = pstate.sizes.pp, pstate.sizes.vpp
    ranges = stage_layers(config, pp * vpp, layout, seq_length)
    chunks = []
    for c in range(vpp):
        s = c * pp + pstate.pp_rank
        with torch.device(device):
            chunks.append(spec.build(config, layers=ranges[s], first=s == 0, last=s == pp * vpp - 1,
                                     experts=_expert_range(config, pstate), seed=seed))
    return chunks


def _expert_range(config, pstate: ParallelState) -> range | None:
    if not config.num_experts:
        return None
    local = config.num_experts // pstate.sizes.ep
    return range(pstate.ep_rank * local, (pstate.ep_rank + 1) * local)

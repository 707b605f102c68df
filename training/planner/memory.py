"""Memory plan per rank, without allocating anything: each rank's share of the model is built on
the meta device for the real layout (``shares.py``, cached), its tensors counted, and
activations taken from ``core/costs/activations.py`` (the family's block shapes) times the schedule's peak in-flight micro-batches
(from the pipeline simulator).

Parameters, gradients and optimizer state follow what this code allocates: parameters are
always fp32 (under ``bf16`` they are the master weights), gradients are fp32 (accumulated and
reduced so under ``bf16`` too), optimizer state in the parameter dtype (AdamW: two moments plus a
4-byte step per tensor; Muon: one buffer, none at momentum 0; Dion: a buffer and the n x r
factor). Activations, p2p and all-to-all buffers and gathered compute copies take the compute
dtype (2 bytes under ``bf16``). Activations assume a fused attention kernel (flash / flex /
Transformer Engine: no score matrix). Under ``--overlap-moe-expert-parallel-comm`` the joined
weight gradients' kept output gradients and concatenations within an MoE block's backward are
their own column (``overlap.py``: ``joined_grads_bytes``).

FSDP (``core/distributed/fsdp.py``, see :func:`placement`): with ``--data-parallel-sharding fsdp`` dense
tensors are split over the data-parallel ranks and expert tensors over the expert-data-parallel
ranks (dim 0, padded like FSDP2). Units are gathered per micro-batch and pass (a block's outer
and inner units, and the block below's outer unit only where FSDP2's backward prefetch reaches
it: :func:`gathered_blocks`; FSDP2 keeps the root unit gathered from forward to backward), or for the
whole step (``fsdp_gather_once``, one-rank meshes, and ``cpu_offload="optimizer"``). While
gradient sync is off (every backward of the step but each chunk's last), every unit's gradient
accumulates *unsharded, in fp32, on the device*, whatever the offload mode: it only reaches its
(possibly host) shard at the synchronising backward. ``cpu_offload="optimizer"`` syncs on every
backward instead, so only one unit's unsharded gradient is alive at a time. CPU offload keeps
the offloaded shards, their gradients and optimizer state in host memory.

Context parallelism (``cp`` ranks split each pack, ``core/context_parallel/``): every rank's
activations, p2p and all-to-all buffers are those of its ``T / cp`` tokens; dense replicas (and
FSDP's dense shards) span DP x CP, expert shards expert-DP = DP x CP / EP. On top, each attention
layer that is not recomputed keeps its key buffer for the backward (``cp K/V``:
``core/context_parallel/costs.py``: ``(1 + 1/2cp) T`` rows of K and V on full layers, ``T / cp``
plus a halo of up to ``2 (window - 1)`` on sliding ones), with one full layer's all-gathered
``T`` rows alive while its buffer is cut from them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from core.costs.activations import block_bytes, extra_block_bytes, head_bytes
from core.context_parallel.costs import gathered_bytes, key_buffer_bytes
from core.memory_mode import KINDS, Placement
from core.optim.registry import OptimOptions
from core.optim.build import classify
from core.optim.host_masters import STAGING
from models.registry import shapes_of
from training.planner.inputs import MASTER, PlanInputs
from training.planner.overlap import joined_grads_bytes
from training.planner.shares import ROOT, ChunkShare, block_numel, kind_block_numel, schedule_facts
from training.planner.vision import VISION_BLOCK, planned_shares, vision_bytes, vision_working_set

GB = 10**9
HOST_STAGING = STAGING  # --cpu-offload masters: pinned bytes per element, one slab per rank (host_masters.py)
# An MoE layer's [tokens x top-k, hidden] row buffers live at once beyond what it keeps for the
# backward (core/moe/dispatch.py; each freed at its wait, regrouping or reordering): forward, the
# rows in flight and the rows received (or the experts' output and its reordered copy); backward,
# the combine's gradient in token order and in the experts' order, then the all-to-all's send and
# receive. Both halves of the overlap (core/moe/overlap.py) together hold as many.
A2A_BUFFERS = 2


COLUMNS = ("parameters", "gradients", "unsharded grads", "optimizer", "activations", "recompute working set",
           "cp K/V", "p2p buffers", "all-to-all buffers", "joined grads", "gathered layers")  # device columns


def placement(inp: PlanInputs) -> Placement:
    """What ``core/distributed/fsdp.apply_fsdp`` does with this layout: the mode's placement
    (``core/memory_mode.MemoryMode.placement``)."""
    return inp.mode.placement(inp.sizes, inp.num_microbatches, lora=inp.lora_rank > 0)


@dataclass
class RankMemory:
    pp_rank: int
    ep_rank: int
    parameters: int = 0                 # count, this rank's share
    device: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    fits: bool = True
    overlap: int = 0                    # device bytes of two columns that are never alive together

    @property
    def device_total(self) -> int:
        """Peak device bytes: the columns' sum less ``overlap`` (sharded gradients appear as the
        synchronising backward frees the unsharded accumulators they come from)."""
        return sum(self.device.values()) - self.overlap

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def _shard_numel(t, world: int) -> int:
    if world <= 1 or t.dim() == 0:
        return t.numel()
    return math.ceil(t.shape[0] / world) * (t.numel() // t.shape[0])


def _optimizer_bytes(spec, t, numel: int, optim: OptimOptions) -> int:
    if classify(spec, t, optim.optimizer) != "matrix":
        return 2 * numel * MASTER + 4  # AdamW moments + fp32 step counter
    return optim.spec.state_bytes(t.shape, numel, optim)  # as the optimizer declares, with its options


@lru_cache(maxsize=4096)
def tally(chunk: ChunkShare, dense_world: int, expert_world: int, optim: OptimOptions) -> dict:
    """Per kind: parameters whole (``numel``; ``fp32``: those computing in fp32 under bf16) and
    as this rank's shards (``shard``), and the optimizer state of the shards in bytes (``optim``:
    the optimizer and its declared options)."""
    optimizer = optim.optimizer
    out = {k: {"numel": 0, "fp32": 0, "shard": 0, "optimizer": 0, "fp32_shard": 0, "matrix_shard": 0,
               "frozen_numel": 0, "frozen_shard": 0, "frozen_fp32_shard": 0} for k in KINDS}
    for s in chunk.tensors:
        kind = "expert" if s.expert else "dense"
        numel = _shard_numel(s.t, expert_world if s.expert else dense_world)
        out[kind]["numel"] += s.t.numel()
        out[kind]["fp32"] += s.t.numel() if s.fp32 else 0
        out[kind]["shard"] += numel
        out[kind]["fp32_shard"] += numel if s.fp32 else 0
        if s.frozen:  # a LoRA base: stored, gathered, never updated (no gradient, no optimizer state)
            out[kind]["frozen_numel"] += s.t.numel()
            out[kind]["frozen_shard"] += numel
            out[kind]["frozen_fp32_shard"] += numel if s.fp32 else 0
            continue
        out[kind]["matrix_shard"] += numel if classify(s.spec, s.t, optimizer) == "matrix" else 0
        out[kind]["optimizer"] += _optimizer_bytes(s.spec, s.t, numel, optim)
    return out


def _gradient_bytes(t: dict, inp: PlanInputs, pl: Placement) -> int:
    """One kind's sharded gradients kept until the optimizer step: bf16 for remainder-stored
    parameters (fp32 routers stay fp32); none for the matrices stepped in the backward."""
    keep = t["shard"] - t["frozen_shard"] - t["matrix_shard"] * pl.in_backward
    fp32 = t["fp32_shard"] - t["frozen_fp32_shard"]
    return (keep - fp32) * inp.grad_bytes + fp32 * MASTER


def _parameter_bytes(t: dict, inp: PlanInputs) -> int:
    """One kind's stored parameters: fp32 (or bf16 + remainder) masters; a frozen LoRA base its
    one copy, in the compute dtype (``core.finetune.lora.frozen_to_bf16``; its fp32 routers stay fp32)."""
    frozen = t["frozen_shard"] - t["frozen_fp32_shard"]
    return t["shard"] * MASTER - frozen * (MASTER - inp.act_bytes)


def chunk_tally(chunk: ChunkShare, inp: PlanInputs, pl: Placement) -> dict:
    return tally(chunk, pl.shard_world["dense"], pl.shard_world["expert"], inp.optim)


def _managed_blocks(chunk: ChunkShare, pl: Placement) -> dict:
    """Managed parameters per FSDP block (every block, unless experts are left out of FSDP)."""
    if pl.managed["expert"] or not pl.managed["dense"]:
        return block_numel(chunk) if pl.managed["dense"] else {}
    return kind_block_numel(chunk, False)


def _plain_blocks(chunk: ChunkShare, pl: Placement) -> dict:
    """Parameters per block that FSDP does not manage (experts left out of it, or everything)."""
    managed, out = pl.managed, {}
    for kind in ("dense", "expert"):
        if not managed[kind]:
            for block, n in kind_block_numel(chunk, kind == "expert").items():
                out[block] = out.get(block, 0) + n
    return out


@dataclass
class _Managed:
    """What FSDP manages on a rank (its units' parameters whole, the fp32 ones, its sharded
    gradients on the device) and its units' sizes (the largest block; the root's)."""

    numel: int = 0
    trained: int = 0  # of them, those that get gradients (all but a frozen LoRA base)
    fp32: int = 0
    device_grads: int = 0
    largest_block: int = 0
    root: int = 0  # FSDP2 keeps the root gathered forward to backward
    blocks_gathered: int = 0  # bytes of the blocks' units gathered at the peak (:func:`_blocks_gathered`)
    largest_gathered: int = 0  # bytes: the most of a block's units gathered at once (:func:`gathered_blocks`)


def rank_memory(cfg, chunks: list, inp: PlanInputs, pp_rank: int, ep_rank: int = 0,
                pl: Placement | None = None) -> RankMemory:
    """One rank's plan from its chunks' shares (``shares.rank_shares``): each column from the
    placement the memory mode gives (``core/memory_mode.py``), one function a column."""
    pl = pl or placement(inp)
    facts = schedule_facts(inp.pp, inp.vpp, inp.num_microbatches)
    T, b, H = inp.local_tokens, inp.act_bytes, cfg.hidden_size
    r = RankMemory(pp_rank, ep_rank)
    dev = dict.fromkeys(COLUMNS, 0)
    host = dict.fromkeys(("parameters", "gradients", "optimizer", "activations"), 0)
    managed = _stored(chunks, inp, pl, dev, host, r)
    in_flight = facts.peak_in_flight[pp_rank]
    dev["activations"], host["activations"] = _activations(cfg, chunks, inp, in_flight)
    dev["recompute working set"], before_layers = _working_set(cfg, chunks, inp)
    dev["cp K/V"] = _cp_columns(cfg, chunks, inp, in_flight)
    dev["unsharded grads"], r.overlap = _unsharded_grads(chunks, inp, pl, managed)
    unmet = 0  # of the kept activations, bytes the peak does not meet
    if inp.num_microbatches == 1 and inp.pp == 1:
        # one micro-batch: the backward frees the kept activations as it makes the gradients
        # the step keeps, so the two never coexist whole (the memory trace, docs/memory.md)
        unmet = min(dev["gradients"], dev["activations"])
    # the heads' and MTP depths' kept activations are freed before a decoder layer's backward
    r.overlap += unmet + min(before_layers, dev["activations"] - unmet)
    managed.blocks_gathered = _blocks_gathered(cfg, chunks, inp, pl, managed, dev["recompute working set"])
    dev["gathered layers"] = _gathered_layers(inp, pl, managed,
                                              dev["unsharded grads"] + dev["recompute working set"])
    dev["p2p buffers"] = facts.p2p_buffers[pp_rank] * T * H * b
    if inp.ep > 1:
        dev["all-to-all buffers"] = A2A_BUFFERS * inp.chunk_tokens * cfg.num_experts_per_tok * H * b
    # the overlap's joined weight gradients, within an MoE block's backward (overlap.py)
    dev["joined grads"] = max(joined_grads_bytes(cfg, c, inp) for c in chunks)
    r.device, r.host = dev, host
    r.fits = r.device_total <= inp.device_gb * GB
    return r


def _stored(chunks: list, inp: PlanInputs, pl: Placement, dev: dict, host: dict, r: RankMemory) -> _Managed:
    """Parameters, their kept gradients and optimizer state, on the device or the host as placed;
    returns what FSDP manages."""
    m = _Managed()
    for chunk in chunks:
        t = chunk_tally(chunk, inp, pl)
        for kind in KINDS:
            where = host if pl.offloaded[kind] else dev
            if pl.host_masters:  # bf16 on the device; fp32 master (pageable) + one pinned bf16 slot on the host
                bf16 = t[kind]["shard"] - t[kind]["fp32_shard"]  # the fp32 routers stay on the device
                dev["parameters"] += bf16 * 2 + t[kind]["fp32_shard"] * MASTER
                host["parameters"] += bf16 * MASTER          # the fp32 master, pageable: as allocated
                host["gradients"] += bf16 * HOST_STAGING     # the pinned slab's slot: update in, new weight out
                host["optimizer"] += t[kind]["optimizer"]
                dev["gradients"] += _gradient_bytes(t[kind], inp, pl)
            else:
                where["parameters"] += _parameter_bytes(t[kind], inp)  # fp32, or bf16 + 2-byte remainder
                where["gradients"] += _gradient_bytes(t[kind], inp, pl)
                where["optimizer"] += t[kind]["optimizer"]
            r.parameters += t[kind]["shard"]
            if pl.managed[kind]:
                m.numel += t[kind]["numel"]
                m.trained += t[kind]["numel"] - t[kind]["frozen_numel"]
                m.fp32 += t[kind]["fp32"]
                m.device_grads += 0 if pl.offloaded[kind] else _gradient_bytes(t[kind], inp, pl)
        blocks = _managed_blocks(chunk, pl)
        m.largest_block = max([m.largest_block, *(n for k, n in blocks.items() if k is not ROOT)])
        m.root += blocks.get(ROOT, 0)
    return m


def gathered_blocks(chunk: ChunkShare, inp: PlanInputs, pl: Placement) -> dict:
    """Per block (its id), the most bytes of FSDP units gathered at once in its backward (per
    micro-batch and pass; the root apart), as FSDP2 gathers and frees them
    (``core/distributed/fsdp.py``). A block is an outer unit ``O`` (its own parameters) around
    inner units in forward order: the router ``R`` (its own unit, in fp32, under bf16) and the
    experts ``E`` (where FSDP manages them). FSDP2 frees a unit after its forward (not after a
    recompute's rerun inside the backward: that leaves it gathered until its own backward) and
    after its backward; a unit's pre-backward gathers the unit whose forward ended just before its
    own: ``O``'s gathers ``E``, ``E``'s gathers ``R``, and ``R``'s (the block's first inner unit)
    gathers the block below's ``O``, when ``E`` has been freed. So a block's backward holds
    ``O + R + E``, then ``O + R + O_below`` (``O + E + O_below`` without a router unit,
    ``O + O_below`` without inner units): two blocks meet only where the block below's outer unit
    outweighs the experts. Under ``--recompute-chunks`` a block's pre-backward gathers its inner
    units and ``O_below`` at once (``fsdp.backward_prefetch_order``): ``O + R + E + O_below``.
    A forward holds ``O`` and one inner unit, never more."""
    b = inp.act_bytes
    router_unit = pl.bf16  # a unit the model marks fp32 is its own unit only under bf16 (apply_fsdp)
    sizes: dict = {}
    for s in chunk.tensors:
        if s.block is ROOT or (s.expert and not pl.managed["expert"]):
            continue
        o, r, e = sizes.get(s.block, (0, 0, 0))
        n = s.t.numel()
        if s.expert:
            e += n * b
        elif s.fp32 and router_unit:
            r += n * MASTER  # FSDP gathers it in fp32
        else:
            o += n * b
        sizes[s.block] = (o, r, e)
    tower = sorted((k for k in sizes if k <= VISION_BLOCK), reverse=True)
    extra = sorted((k for k in sizes if VISION_BLOCK < k < 0), reverse=True)
    chunked = pl.recompute_placement.full and pl.recompute_placement.chunked
    out, below = {}, 0
    for block in [*tower, *chunk.layers, *extra]:
        if chunk.layers and block == chunk.layers[0]:
            below = 0  # the unit before it is the image projector's, booked with the root
        o, r, e = sizes.get(block, (0, 0, 0))
        first = r or e  # the router runs before the experts
        out[block] = o + r + e + below if chunked else max(o + r + e, o + first + below)
        below = o
    return out


def _blocks_gathered(cfg, chunks: list, inp: PlanInputs, pl: Placement, m: _Managed, working_set: int) -> int:
    """The blocks' gathered units beside the recompute working set (``working_set``, booked at its
    largest): a block's backward holds its own working set and its gathered units
    (:func:`gathered_blocks`) together, so the two columns' sum is the most of that over the blocks
    (the image tower's working set: its blocks' gathered units, none of the decoder's). With one
    stage per rank the root is freed once the heads' and MTP depths' backward is done (see
    :func:`_gathered_layers`): an MTP depth's backward holds it beside its own."""
    if not pl.managed["dense"]:
        return 0
    root = m.root * inp.act_bytes if inp.pp == 1 else 0
    joint = 0
    for c in chunks:
        gathered = gathered_blocks(c, inp, pl)
        layers, others = _recompute_sets(cfg, c, inp.chunk_tokens, inp.act_bytes, inp)
        ws = dict(zip(c.layers, layers))
        if c.last and others and inp.recompute_placement.recomputes_extra(len(c.layers)):
            ws.update({-1 - k: w for k, w in enumerate(others[:len(shapes_of(cfg).extra)])})
        tower = max((g for k, g in gathered.items() if k <= VISION_BLOCK), default=0)
        joint = max([joint, *(others[-1] + tower for _ in others[-1:] if c.first),
                     *(ws.get(k, 0) + g + (root if VISION_BLOCK < k < 0 else 0) for k, g in gathered.items())])
        m.largest_gathered = max([m.largest_gathered, *gathered.values()])
    return max(joint - working_set, 0)


def _activations(cfg, chunks: list, inp: PlanInputs, in_flight: int) -> tuple[int, int]:
    """(device, host) bytes of the activations kept for the backward: the schedule's peak
    in-flight micro-batches (the simulator's, spread over the rank's chunks); with
    ``--offload-recompute-inputs`` the recomputed blocks' kept inputs wait on the host."""
    b = inp.act_bytes
    kept = sum(_chunk_activations(cfg, c, inp.local_tokens, b, inp) for c in chunks) * in_flight // len(chunks)
    moved = sum(offloaded_inputs(cfg, c, inp) for c in chunks) * in_flight // len(chunks)
    return kept - moved, moved


def _cp_columns(cfg, chunks: list, inp: PlanInputs, in_flight: int) -> int:
    """Context parallelism's key buffers for the in-flight micro-batches and the largest
    all-gathered pool (``_cp_key_buffers``)."""
    buffers = [_cp_key_buffers(cfg, c, inp) for c in chunks]
    return sum(k for k, _ in buffers) * in_flight // len(chunks) + max(p for _, p in buffers)


def _unsharded_grads(chunks: list, inp: PlanInputs, pl: Placement, m: _Managed) -> tuple[int, int]:
    """(bytes, overlap) of the gradients alive before they reach their shards, as the mode makes
    them: FSDP's fp32 accumulators for the whole step while sync is off (several micro-batches;
    the sharded gradients appear as the synchronising backward frees them: ``overlap``), else one
    unit's gradient at a time (autograd's in the compute dtype, FSDP's fp32 copy for the reduce);
    under ``--recompute-chunks`` the block the backward is making sums its chunks' gradients in
    fp32 (FSDP's units as over micro-batches, counted above; a block's parameters FSDP does not
    manage in an fp32 sum each gradient joins as autograd stores it: the sum in place of the
    block's gradient, and one tensor's gradient beside it, ``core/transformer/chunked.py``); under
    ``--optimizer-in-backward`` parameters FSDP does not manage keep their gradients until their
    hooks step them on the steps' own stream, behind the backward: the block it is stepping and
    the block the backward is making (``core/optim/in_backward.py``)."""
    b, total, overlap = inp.act_bytes, 0, 0
    if m.numel:
        if inp.num_microbatches > 1 and not pl.sync_every_microbatch:
            total = m.trained * MASTER  # fp32 accumulators, sync off (none for a frozen base)
            overlap = min(m.device_grads, total)
        else:  # a frozen base (LoRA) has no gradient: the unit's trained share of it
            total = max(m.largest_block, m.root) * (b + MASTER if b < MASTER else MASTER) * m.trained // m.numel
    plain = max((n for c in chunks for k, n in _plain_blocks(c, pl).items() if k is not ROOT), default=0)
    if pl.recompute_placement.chunked:
        tensor = max((x.t.numel() for c in chunks for x in c.tensors
                      if x.block is not ROOT and not pl.managed["expert" if x.expert else "dense"]), default=0)
        total += plain * (MASTER - b) + tensor * b
    if pl.in_backward:
        total += 2 * plain * b
    return total, overlap


def _gathered_layers(inp: PlanInputs, pl: Placement, m: _Managed, unsharded_grads: int) -> int:
    """FSDP's gathered compute copies: gathered once, every managed unit (fp32 routers in fp32);
    per micro-batch and pass, the blocks' units beside their working sets (:func:`_blocks_gathered`)
    and the root. With one stage per rank the root's weights are freed once the heads' and MTP
    depths' backward is done (``core/distributed/fsdp.py``): held through the forward (beside the
    largest block's units), not beside the decoder layers' backward, whose gradient bytes and
    recompute working set (``unsharded_grads``, both) the forward does not hold, so the peak is the
    larger of the two phases (a frozen base, LoRA: no gradient, the working set alone, as the
    memory trace finds)."""
    if not m.numel:
        return 0
    b = inp.act_bytes
    if not pl.gather_per_microbatch:
        return m.numel * b + m.fp32 * (MASTER - b)
    if inp.pp > 1:
        return m.blocks_gathered + m.root * b
    # the forward (the root and a block) or the backward (the blocks beside their working sets)
    return max(m.blocks_gathered, m.largest_gathered + m.root * b - unsharded_grads)


def plan(cfg, inp: PlanInputs) -> list[RankMemory]:
    """Every (pipeline rank, EP rank)'s plan; ranks that differ only in expert-DP replica plan
    the same."""
    sizes = inp.sizes
    sizes.validate(cfg.num_layers, cfg.num_experts)
    shares = planned_shares(cfg, inp)
    pl = placement(inp)
    out = []
    for pp_rank in range(inp.pp):
        first = rank_memory(cfg, shares[pp_rank], inp, pp_rank, 0, pl)
        for ep_rank in range(inp.ep):  # EP ranks hold shares of the same shapes
            out.append(first if ep_rank == 0 else RankMemory(**{**asdict(first), "ep_rank": ep_rank}))
    return out


def _working_set(cfg, chunks: list, inp: PlanInputs) -> tuple[int, int]:
    """(the recompute working set: the largest of the chunks' :func:`_recompute_sets`; what of the
    kept activations never meets it). The backward runs a chunk's heads and MTP depths (last in
    its forward) before its decoder layers and frees what they kept, so a layer's working set
    meets the activations less that (:func:`_kept_after_layers`); an MTP depth's or the tower's
    meets them whole."""
    best = peak = 0
    for c in chunks:
        layers, others = _recompute_sets(cfg, c, inp.chunk_tokens, inp.act_bytes, inp)
        freed = _kept_after_layers(cfg, c, inp)
        best = max([best, *layers, *others])
        peak = max([peak, *(w - freed for w in layers), *others])
    return best, best - peak


def _recompute_working_set(cfg, chunk, T: int, b: int, inp: PlanInputs) -> int:
    """The largest of one chunk's :func:`_recompute_sets` at ``T`` tokens."""
    layers, others = _recompute_sets(cfg, chunk, T, b, inp)
    return max([*layers, *others], default=0)


def _kept_after_layers(cfg, chunk, inp: PlanInputs) -> int:
    """Device bytes one micro-batch keeps for the chunk's heads and MTP depths (the last chunk's):
    :func:`_chunk_activations`' share after the decoder layers, less the depths' inputs that
    ``--offload-recompute-inputs`` keeps on the host."""
    if not chunk.last:
        return 0
    shapes, T, b, rc = shapes_of(cfg), inp.local_tokens, inp.act_bytes, inp.recompute_placement
    extra = rc.extra(len(chunk.layers))
    kept = head_bytes(shapes, T, b) + sum(extra_block_bytes(shapes, k, T, b, extra, inp.lora)
                                          for k in range(len(shapes.extra)))
    if rc.offload_inputs and rc.recomputes_extra(len(chunk.layers)):
        kept -= 2 * len(shapes.extra) * T * cfg.hidden_size * b  # as kept_inputs counts them
    return max(kept, 0)


def _recompute_sets(cfg, chunk, T: int, b: int, inp: PlanInputs) -> tuple[list, list]:
    """What each recomputed block holds again during its backward: its whole activations less
    what recompute kept (a frozen LoRA base's whole activations: ``block_bytes`` with
    ``inp.lora``); ``(the decoder layers', the MTP depths' and the vision tower's)``."""
    rc = inp.recompute_placement
    if not rc.on:
        return [], []
    shapes = shapes_of(cfg)
    kv = lambda i: key_buffer_bytes(shapes.block(i).attention, inp.tokens, inp.cp, b)  # gathered again
    layers = [block_bytes(shapes, int(i), T, b, "none", inp.lora) - block_bytes(shapes, int(i), T, b, rc.granularity)
              + kv(int(i)) for i in chunk.layers[:rc.num_selected(len(chunk.layers))]]
    others = []
    if chunk.last and rc.recomputes_extra(len(chunk.layers)):
        others += [extra_block_bytes(shapes, k, T, b, "none", inp.lora)
                   - extra_block_bytes(shapes, k, T, b, rc.granularity) + kv(-1 - k) for k in range(len(shapes.extra))]
    if chunk.first:
        others.append(vision_working_set(cfg, inp))
    return layers, others


def _cp_key_buffers(cfg, chunk, inp: PlanInputs) -> tuple[int, int]:
    """Context parallelism: the key buffers the chunk's attention layers keep for one
    micro-batch (layers whose recompute mode is "none"; a recomputed layer gathers again in its
    backward, counted in its working set), and the largest all-gathered pool of a full layer
    (transient, once per rank)."""
    if inp.cp == 1:
        return 0, 0
    shapes, T, b, rc = shapes_of(cfg), inp.tokens, inp.act_bytes, inp.recompute_placement
    kept = sum(key_buffer_bytes(shapes.block(int(i)).attention, T, inp.cp, b)
               for k, i in enumerate(chunk.layers) if rc.layer(k) == "none")
    blocks = [shapes.block(int(i)) for i in chunk.layers]
    if chunk.last:
        extra_kept = rc.extra(len(chunk.layers)) == "none"
        kept += sum(key_buffer_bytes(s.attention, T, inp.cp, b) for s in shapes.extra) if extra_kept else 0
        blocks += list(shapes.extra)
    return kept, max((gathered_bytes(s.attention, T, inp.cp, b) for s in blocks), default=0)


def kept_inputs(cfg, chunk, inp: PlanInputs) -> int:
    """Bytes of one micro-batch's inputs that the chunk's fully recomputed blocks keep for their
    backward: a decoder layer's hidden state, an MTP depth's shifted embedding and previous
    hidden state (what ``--offload-recompute-inputs`` copies out and back)."""
    one, rc = inp.local_tokens * cfg.hidden_size * inp.act_bytes, inp.recompute_placement
    inputs = rc.num_selected(len(chunk.layers)) * one
    if chunk.last and rc.recomputes_extra(len(chunk.layers)):
        inputs += 2 * len(shapes_of(cfg).extra) * one
    return inputs


def offloaded_inputs(cfg, chunk, inp: PlanInputs) -> int:
    """Bytes ``--offload-recompute-inputs`` keeps in host memory for one micro-batch: the kept
    inputs less the one block's (two tensors at most) back on the device for its backward."""
    if not inp.recompute_placement.offload_inputs:
        return 0
    return max(kept_inputs(cfg, chunk, inp) - 2 * inp.local_tokens * cfg.hidden_size * inp.act_bytes, 0)


def _chunk_activations(cfg, chunk, T: int, b: int, inp: PlanInputs) -> int:
    shapes, total, rc = shapes_of(cfg), 0, inp.recompute_placement
    for k, i in enumerate(chunk.layers):
        total += block_bytes(shapes, int(i), T, b, rc.layer(k), inp.lora)
    if not chunk.first:
        total += T * cfg.hidden_size * b  # the received hidden state waits for its gradient
    else:
        total += vision_bytes(cfg, inp)  # the image encoder's (0 without images)
    if chunk.last:
        total += head_bytes(shapes, T, b)
        extra = rc.extra(len(chunk.layers))
        for k in range(len(shapes.extra)):  # extra (MTP) blocks: as apply_recompute sets them
            total += extra_block_bytes(shapes, k, T, b, extra, inp.lora)
    return total


def as_dict(ranks: list[RankMemory]) -> list[dict]:
    return [{**asdict(r), "device_total": r.device_total, "host_total": r.host_total} for r in ranks]


def format_table(ranks: list[RankMemory], inp: PlanInputs) -> str:
    cols = list(COLUMNS)
    short = ["params", "grads", "unshard", "optim", "activ", "recomp", "cp K/V", "p2p", "a2a", "joined", "gathered"]
    head = f"{'rank':<10}{'params #':>14}" + "".join(f"{s:>10}" for s in short) + \
        f"{'device':>10}{'host':>10}  fits {inp.device_gb:g} GB"
    lines = ["all sizes in GB (1e9 bytes); device columns unless noted; device is the peak (sharded "
             "grads replace the unsharded ones at the synchronising backward)", head]
    for r in ranks:
        lines.append(f"pp{r.pp_rank} ep{r.ep_rank:<4}{r.parameters:>14,}" +
                     "".join(f"{r.device[c] / GB:>10.1f}" for c in cols) +
                     f"{r.device_total / GB:>10.1f}{r.host_total / GB:>10.1f}  {'yes' if r.fits else 'NO'}")
    return "\n".join(lines)

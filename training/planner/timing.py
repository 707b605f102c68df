"""Predicted step time per rank, next to the memory plan: what each rank computes and moves in
one step, turned into seconds by assumed efficiencies and bandwidths (``TimeAssumptions``, the
planner's flags). These are predictions, not measurements.

Per micro-batch and virtual stage (what the pipeline simulator schedules):

- compute: forward FLOPs of the stage (``core/costs/flops.py`` over the family's block shapes: matmuls, attention over the keys a causal
  document of ``seq_length`` sees; the last stage adds the head and the extra blocks); backward
  is twice the forward (LoRA: less the weight gradients of the frozen base, one forward of its
  matmuls, plus the adapters' small GEMMs, ``lora_flops``); recompute (full or selective: both rerun every matmul of attention and
  the FFN) adds one forward of the recomputed layers (and of the extra blocks up to their heads
  when every layer of the chunk is recomputed); the chunked loss reruns each head's logits in
  its backward (one more head forward, recompute or not); at ``assumed_mfu`` of the peak;
- all-to-all: each MoE layer dispatches and combines ``T x top_k x hidden`` activations, of
  which ``(ep - 1) / ep`` leave the rank, in forward, in backward, and again when recomputed;
  a shared expert's forward runs while its layer's dispatch is in flight (the code overlaps
  them), hiding up to the dispatch's time; with ``--overlap-moe-expert-parallel-comm`` each
  all-to-all of one half of the micro-batch hides behind the other half's compute
  (``overlap.py``: the schedule, its formula and assumptions);
- p2p: one ``[T, hidden]`` message per stage boundary each way;
- context parallelism (``cp`` ranks per pack): every per-token cost above is the rank's
  ``T / cp`` tokens' (a causal document's work splits evenly: ``core/context_parallel/shard.py``),
  and each attention layer moves K/V over the CP group (``core/context_parallel/costs.py``): a
  full layer's all-gather (``(cp - 1) / cp`` of ``T`` rows of K and V) in the forward, the
  reduce-scatter of their gradients in the backward and the gather again when recomputed; a
  sliding layer's halo (at most ``2 (window - 1)`` rows) the same three times. Not overlapped
  with the attention (the code gathers the whole K/V before its call). MLA moves its latent
  instead and expands the key buffer's rows on every rank: ``kv_b_proj`` on ``(1 + 1/2N) T`` rows
  rather than its ``T / N`` tokens, booked as compute (``expand_flops``);
- weights gathered per pass (FSDP without gather-once): the offloaded fp32 shards host to
  device (4 bytes per shard parameter) and the all-gather of the compute copies, for the forward
  and again for the backward;
- ``cpu_offload="optimizer"``: every backward reduce-scatters in fp32 and sends the fp32
  gradient shards device to host.

Once per step and rank, after the pipeline: weights gathered once (gather-once, one-rank
meshes, ``optimizer`` offload), the gradient reduce-scatter (or all-reduce where FSDP does not
shard) and the shards' device-to-host copy, the tied embedding's all-reduce, and the optimizer:
AdamW at memory bandwidth (28 bytes per parameter: p, g, m, v read; p, m, v written) on the host
for offloaded shards, Muon's Newton-Schulz on the GPU matrix by matrix (row-sharded matrices
by one owner each, in the batches the code forms: the busiest owner's FLOPs and the two
all-to-alls; offloaded ones travel host to device and back), Dion's power iteration likewise;
``cpu_offload="masters"``: the host's updates and their copies.

Three overlaps are counted, because the code has them: under ``cpu_offload="masters"`` with
``optimizer_in_backward`` the host's work on Muon's matrices (updates to the host, master
updates on worker threads, new weights back) runs while the backward does, and only what
outlasts the backward (at least the last block's share) adds to the step; with
``optimizer_in_backward`` Newton-Schulz runs on a stream of its own and fills the compute
stream's waits for the backward's all-to-alls, as far as it is queued before them
(``hidden_newton_schulz``); the shared expert's forward runs while its layer's dispatch is in
flight (the all-to-all dispatcher), and with the overlap flag the all-to-alls behind the other
chunk's compute (``overlap.py``). Nothing else overlaps (conservative: FSDP prefetch and copy
engines do overlap some of it on a GPU). The step is the pipeline's makespan under these per-stage costs (bubble
and stage imbalance included, from ``core.pipeline.simulate``) plus the slowest rank's
once-per-step work.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from core.cli import POSITIVE, option
from core.context_parallel.costs import exchange_bytes, expand_flops
from core.costs.flops import PEAK_TFLOPS, device_peak_tflops, model_costs
from core.optim.build import classify
from core.optim.muon_split import batches, ns_flops, owners
from core.optim.registry import OptimOptions
from core.pipeline.simulate import plan_makespan
from models.registry import shapes_of
from training.planner.inputs import PlanInputs
from training.planner.memory import (KINDS, MASTER, Placement, _parameter_bytes,
                                     _shard_numel, chunk_tally, kept_inputs, placement)
from training.planner.lora import lora_flops
from training.planner.overlap import block_waits
from training.planner.shares import ChunkShare, schedule_facts
from training.planner.vision import planned_shares, vision_flops

DEFAULT_PEAK = PEAK_TFLOPS["H200"]
ADAMW_BYTES = 28  # fp32 p, g, m, v read; p, m, v written
MUON_BYTES = 12   # p read and written (decay, update), the update read; a momentum buffer adds 12


@dataclass
class TimeAssumptions:
    """Step-time model: assumed efficiency and bandwidths (the planner's predictions)."""

    assumed_mfu: float = option(0.4, "fraction of the dense bf16 peak (--peak-tflops) that every "
                                     "matmul reaches (Newton-Schulz included)")
    pcie_gb_s: float = option(35.0, "host-device GB/s per GPU each way, pinned memory (PCIe 5 x16 peaks "
                                    "at 64; H100 / H200 pinned copies measure about 35-55: the low end)")
    nvlink_gb_s: float = option(150.0, "GB/s per GPU for p2p, all-to-all and data-parallel "
                                       "collectives inside a node (NVLink 4: 450 per direction)")
    network_gb_s: float = option(50.0, "GB/s per GPU for groups that span nodes (one 400 Gb/s NIC "
                                       "per GPU)")
    gpus_per_node: int = option(8, "GPUs per node: which groups span nodes, host memory per node")
    host_gb_s: float = option(52.0, "host memory bandwidth one rank's optimizer step gets on the host, "
                                    "GB/s (a DGX H100 / H200 node's memory measures about 420-480 GB/s, "
                                    "shared by its 8 ranks: the low end)")
    hbm_gb_s: float = option(3000.0, "device memory bandwidth of elementwise optimizer updates, "
                                     "GB/s (H200: 4,800 peak)")

    def __post_init__(self):
        for name in ("assumed_mfu", "pcie_gb_s", "nvlink_gb_s", "network_gb_s", "host_gb_s", "hbm_gb_s"):
            if not POSITIVE[1](getattr(self, name)):  # inf too: a free transfer is no assumption
                raise ValueError(f"--{name.replace('_', '-')} must be {POSITIVE[0]}, got {getattr(self, name)}")
        if self.assumed_mfu > 1:
            raise ValueError(f"--assumed-mfu must be in (0, 1], got {self.assumed_mfu}")
        if self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")


def peak_tflops(flag: float | None) -> float:
    """--peak-tflops, else the local GPU's known peak, else the H200's (the recipes' target)."""
    return flag or device_peak_tflops() or DEFAULT_PEAK


BREAKDOWN = ("compute", "all-to-all", "p2p", "cp comm", "host-device", "dp comm", "optimizer", "idle")


@dataclass
class RankTime:
    pp_rank: int
    seconds: dict = field(default_factory=dict)  # BREAKDOWN -> seconds of this rank's step
    bytes: dict = field(default_factory=dict)    # host-device, nvlink/network bytes per step

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclass
class StepTime:
    ranks: list            # RankTime per pipeline rank (EP ranks of a stage time the same)
    step_s: float          # the slowest rank's step
    slowest: int           # its pipeline rank
    makespan_s: float      # forward and backward of every micro-batch, pipeline included
    bubble: float          # idle fraction of ranks x makespan (bubble and stage imbalance)
    tokens_per_s_per_gpu: float
    mfu: float             # model FLOPs (no recompute) / (step x world x peak)
    peak_tflops: float
    assumptions: dict


_COSTS: dict = {}


def _costs(cfg, seq_length: int):
    key = (type(cfg).__name__, repr(cfg), seq_length)
    if key not in _COSTS:
        _COSTS[key] = model_costs(shapes_of(cfg), seq_length)
    return _COSTS[key]


def _stage_flops(cfg, chunk: ChunkShare, inp: PlanInputs) -> tuple[float, float]:
    """Forward FLOPs per token of the chunk, and those its recompute repeats."""
    c = _costs(cfg, inp.seq_length)
    fwd = sum(c.blocks[i] for i in chunk.layers) + (c.last_extra if chunk.last else 0.0)
    rc = inp.recompute_placement
    redo = sum(c.blocks[i] for i in chunk.layers[:rc.num_selected(len(chunk.layers))]) if rc.on else 0.0
    return fwd, redo + (_last_stage_redo(cfg, chunk, inp) if chunk.last else 0.0)


def _last_stage_redo(cfg, chunk: ChunkShare, inp: PlanInputs) -> float:
    """What the last stage reruns besides its layers: every head's logits in the chunked loss's
    backward (``core/loss.py``), and the extra blocks up to their heads when they are recomputed
    (``full`` also reruns the input projection)."""
    shapes, c = shapes_of(cfg), _costs(cfg, inp.seq_length)
    head = 2 * shapes.hidden * shapes.vocab
    redo = head * (1 + sum(1 for b in shapes.extra if b.head))
    rc = inp.recompute_placement
    if rc.extra(len(chunk.layers)) != "none":
        for b, flops in zip(shapes.extra, c.extra):
            proj = 2 * b.input_proj * shapes.hidden if rc.selective else 0
            redo += flops - (head if b.head else 0) - proj
    return redo


def _moe_blocks(cfg, chunk: ChunkShare, inp: PlanInputs) -> tuple[set, set]:
    """The chunk's MoE blocks (layer indices, ``-1 - k`` for extra block ``k``), and those of
    them recomputed."""
    shapes = shapes_of(cfg)
    moe = {i for i in chunk.layers if shapes.blocks[i].ffn.moe}
    rc = inp.recompute_placement
    redo = moe & set(chunk.layers[:rc.num_selected(len(chunk.layers))]) if rc.on else set()
    if chunk.last:
        extra = {-1 - k for k, b in enumerate(shapes.extra) if b.ffn.moe}
        moe |= extra
        if rc.extra(len(chunk.layers)) != "none":
            redo |= extra
    return moe, redo


@lru_cache(maxsize=4096)
def optimizer_work(chunk: ChunkShare, dense_world: int, expert_world: int, opts: OptimOptions,
                   in_backward: bool = False) -> dict:
    """Per kind: AdamW and matrix shard parameters, this rank's FLOPs of orthogonalising (Newton-
    Schulz per iteration ``4 m^2 n + 2 m^3`` for m <= n; Dion ``8 m n r``), the parameters of the
    row-sharded matrices whose Newton-Schulz is split over their mesh (``split``), and the tied
    parameters' shards. Muon under FSDP (``core/optim/muon_split.py``): a stack of whole experts
    is orthogonalised where it is (1/D of the stack's FLOPs); row-sharded matrices are dealt out to
    owners in batches, and a batch takes as long as its busiest owner (``split_ns_flops``)."""
    spec, optimizer = opts.spec, opts.optimizer
    ns_steps = getattr(opts, "muon_ns_steps", 5)  # (row-sharded splits are Muon's)
    out = {k: {"adamw": 0, "matrix": 0, "flops": 0.0, "tied": 0, "split": 0} for k in KINDS}
    split: dict = {k: [] for k in KINDS}
    for s in chunk.tensors:
        if s.frozen:  # a LoRA base: never stepped
            continue
        kind = "expert" if s.expert else "dense"
        world = expert_world if s.expert else dense_world
        shard = _shard_numel(s.t, world)
        o = out[kind]
        o["tied"] += shard if s.spec.tied else 0
        if classify(s.spec, s.t, optimizer) != "matrix":
            o["adamw"] += shard
            continue
        o["matrix"] += shard
        if not spec.splits_row_shards:  # as the optimizer declares, on every rank
            o["flops"] += spec.step_flops(s.t.shape, opts)
        elif world > 1 and s.t.dim() == 2:
            split[kind].append(s)
            o["split"] += shard
        else:  # whole matrices here, or whole experts of a row-sharded stack
            o["flops"] += spec.step_flops(s.t.shape, opts) / (world if s.t.dim() == 3 else 1)
    for kind, tensors in split.items():
        world = expert_world if kind == "expert" else dense_world
        out[kind]["flops"] += split_ns_flops(tensors, world, ns_steps, in_backward)
    return out


def _hook_order(s) -> tuple:
    """Where a tensor's gradient becomes final in the backward: ``_block_order`` of its block."""
    return _block_order(s.block)


def _block_order(block) -> tuple:
    """The backward's order of blocks: the MTP depths (last first), then the decoder layers
    (last first), then the root unit."""
    if block is None:
        return (2, 0)
    return (0, block) if block < 0 else (1, -block)


def split_ns_flops(tensors: list, world: int, ns_steps: int, in_backward: bool) -> float:
    """The busiest owner's Newton-Schulz FLOPs summed over the batches the code forms
    (``core/optim/muon_split.batches``): over the matrices in parameter order at the optimizer
    step, in the order their gradients become final in the backward (``InBackwardSteps``)."""
    return sum(flops for _, flops in split_batches(tensors, world, ns_steps, in_backward))


def split_batches(tensors: list, world: int, ns_steps: int, in_backward: bool) -> list:
    """``(the tensor that closes it, its busiest owner's FLOPs)`` per batch of ``split_ns_flops``."""
    order = sorted(tensors, key=_hook_order) if in_backward else tensors
    busiest = _busiest_per_batch(tuple(tuple(s.t.shape) for s in order), world, ns_steps)
    return [(order[j], flops) for j, flops in busiest]


@lru_cache(maxsize=256)  # the search asks for the same matrices under every memory mode
def _busiest_per_batch(shapes: tuple, world: int, ns_steps: int) -> tuple:
    """``(index of the shape that closes it, its busiest owner's FLOPs)`` per batch."""
    out = []
    for idx in batches(shapes, world):
        batch = [shapes[j] for j in idx]
        own = owners(batch, world)
        out.append((idx[-1], max(sum(ns_flops(x, ns_steps) for x, o in zip(batch, own) if o == r)
                                 for r in range(world))))
    return tuple(out)


@lru_cache(maxsize=64)
def _groups(sizes) -> dict:
    return sizes.group_ranks()


def _crosses(sizes, rank: int, kind: str, gpus_per_node: int) -> bool:
    """Whether this rank's ``kind`` group (or, for "pp", its pipeline ring) spans nodes."""
    node = rank // gpus_per_node
    groups = _groups(sizes)[kind]
    ranks = next((g for g in groups if rank in g), [rank])  # middle stages: no embedding group
    return any(r // gpus_per_node != node for r in ranks)


def _bandwidths(inp: PlanInputs, a: TimeAssumptions, pp_rank: int) -> dict:
    s = inp.sizes
    rank = s.rank_of(dp=0, pp=pp_rank)
    kinds = ("dp", "ep", "expert_dp", "pp", "embedding") + (("cp", "dp_cp") if s.cp > 1 else ())
    return {k: (a.network_gb_s if _crosses(s, rank, k, a.gpus_per_node) else a.nvlink_gb_s) * 1e9
            for k in kinds}


HD, NV = "host-device", "nvlink/network"  # the links bytes are counted on


@dataclass
class _Ledger:
    """Seconds by BREAKDOWN and bytes by link, of one pass of a micro-batch or of the step."""

    seconds: dict = field(default_factory=lambda: dict.fromkeys(BREAKDOWN, 0.0))
    bytes: dict = field(default_factory=lambda: {HD: 0.0, NV: 0.0})
    behind_backward: float = 0.0  # seconds of host work that runs while the backward does (host masters)
    tail: float = 0.0             # ... of it that cannot start before the backward's end (its last block's)
    hidden_ns: float = 0.0        # in-backward Newton-Schulz in the backward's all-to-all waits

    def move(self, key: str, nbytes: float, bytes_per_s: float, link: str = NV) -> None:
        self.seconds[key] += nbytes / bytes_per_s
        self.bytes[link] += nbytes

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


GROUP = {"dense": "dp", "expert": "expert_dp"}  # where each kind's shards and replicas live (cp 1)


def _group(kind: str, inp: PlanInputs) -> str:
    """The group of ``kind``'s shards and replicas: dense ones span DP x CP."""
    return "dp_cp" if kind == "dense" and inp.cp > 1 else GROUP[kind]


def _weights_and_gradients(t: dict, inp: PlanInputs, pl: Placement, bw: dict, pcie: float, host: float,
                           f: _Ledger, bk: _Ledger, step: _Ledger) -> None:
    """FSDP's traffic: offloaded fp32 shards to the GPU and the all-gather of compute copies
    (per pass, or once per step), the fp32 reduce-scatter and the gradient shards back to the
    host (per backward with ``optimizer`` offload, else at the synchronising one); with
    ``optimizer`` offload each backward's shards are also added into the host's fp32
    accumulators (read two, write one: 12 bytes per parameter at the host's bandwidth)."""
    b = inp.act_bytes
    h2d = sum(_parameter_bytes(t[k], inp) for k in KINDS if pl.offloaded[k])  # a frozen bf16 base: 2 bytes
    d2h = sum((t[k]["shard"] - t[k]["frozen_shard"]) * MASTER for k in KINDS if pl.offloaded[k])  # gradients
    gathers = (f, bk) if pl.gather_per_microbatch else (step,) if any(pl.managed.values()) else ()
    for ledger in gathers:
        ledger.move("host-device", h2d, pcie, HD)
        for k in KINDS:
            if pl.managed[k]:
                ledger.move("dp comm", (pl.shard_world[k] - 1) * t[k]["shard"] * b, bw[_group(k, inp)])
    ledger = bk if pl.sync_every_microbatch else step
    ledger.move("host-device", d2h, pcie, HD)  # gradient shards: as many bytes as the fp32 shards
    if pl.sync_every_microbatch:  # FSDP's `grad += new` on the host, on the backward's thread
        bk.seconds["host-device"] += 3 * d2h / host
    for k in KINDS:  # the reduce-scatter of what gets gradients (not a frozen LoRA base)
        if pl.managed[k]:
            ledger.move("dp comm", (pl.shard_world[k] - 1) * (t[k]["shard"] - t[k]["frozen_shard"]) * MASTER,
                        bw[_group(k, inp)])


def _chunk_passes(cfg, chunk: ChunkShare, inp: PlanInputs, eff: float,
                  bw: dict) -> tuple[_Ledger, _Ledger]:
    """Compute, all-to-all and p2p of one micro-batch's forward and backward of ``chunk``."""
    T, b, H = inp.local_tokens, inp.act_bytes, cfg.hidden_size
    f, bk = _Ledger(), _Ledger()
    fwd_f, redo_f = _stage_flops(cfg, chunk, inp)
    skipped, adapters = lora_flops(cfg, chunk, inp)  # LoRA: no weight gradients of the frozen base
    f.seconds["compute"] = (fwd_f + adapters) * T / eff  # T: this rank's CP shard
    bk.seconds["compute"] = (2 * fwd_f + redo_f - skipped + 2 * adapters) * T / eff
    if chunk.stage == 0:  # the image encoder (nothing without images): every CP rank encodes the
        vf = vision_flops(cfg, inp)  # whole pack's images (data/cp_shard.py), so T x cp tokens' worth
        f.seconds["compute"] += vf.forward * inp.tokens / eff
        bk.seconds["compute"] += (vf.backward + vf.redo) * inp.tokens / eff
    moe, redone = _moe_blocks(cfg, chunk, inp)
    a2a = T * cfg.num_experts_per_tok * H * b * (inp.ep - 1) / inp.ep  # dispatch or combine
    if a2a:
        f.move("all-to-all", 2 * len(moe) * a2a, bw["ep"])
        bk.move("all-to-all", 2 * (len(moe) + len(redone)) * a2a, bw["ep"])
        # what waits of it (overlap.py: the shared expert behind its dispatch; with the overlap,
        # each chunk's all-to-alls behind the other chunk's compute)
        waits = block_waits(cfg, chunk, inp, moe, redone, T, eff, a2a / bw["ep"]).values()
        f.seconds["all-to-all"] = sum(w.forward for w in waits)
        bk.seconds["all-to-all"] = sum(w.rerun + w.combine_bwd + w.dispatch_bwd for w in waits)
    if inp.cp > 1:
        fwd_kv, redo_kv = _cp_exchanges(cfg, chunk, inp)
        f.move("cp comm", fwd_kv, bw["cp"])
        bk.move("cp comm", fwd_kv + redo_kv, bw["cp"])
        fwd_x, redo_x = _cp_per_layer(cfg, chunk, inp, expand_flops)  # MLA's key rows expanded
        f.seconds["compute"] += fwd_x / eff
        bk.seconds["compute"] += (2 * fwd_x + redo_x) / eff
    if chunk.stage < inp.pp * inp.vpp - 1:
        f.move("p2p", T * H * b, bw["pp"])
    if chunk.stage > 0:
        bk.move("p2p", T * H * b, bw["pp"])
    return f, bk


def _cp_exchanges(cfg, chunk: ChunkShare, inp: PlanInputs) -> tuple[float, float]:
    """K/V bytes (MLA: latent bytes) the chunk's attention layers receive over the CP group in one
    micro-batch's forward (the backward's gradient exchanges move as many), and those its
    recompute repeats."""
    return _cp_per_layer(cfg, chunk, inp, lambda a, T, cp: exchange_bytes(a, T, cp, inp.act_bytes))


def _cp_per_layer(cfg, chunk: ChunkShare, inp: PlanInputs, cost) -> tuple[float, float]:
    """``cost(attention shape, T, cp)`` summed over the chunk's attention layers (its extra blocks
    on the last stage) for one micro-batch's forward, and over those its recompute repeats."""
    shapes, T, rc = shapes_of(cfg), inp.tokens, inp.recompute_placement
    moved = [(cost(shapes.blocks[i].attention, T, inp.cp), rc.layer(k) != "none")
             for k, i in enumerate(chunk.layers)]
    if chunk.last:
        redo = rc.extra(len(chunk.layers)) != "none"
        moved += [(cost(x.attention, T, inp.cp), redo) for x in shapes.extra]
    return float(sum(x for x, _ in moved)), float(sum(x for x, r in moved if r))


def _sync_and_optimizer(chunk: ChunkShare, t: dict, inp: PlanInputs, a: TimeAssumptions, pl: Placement,
                        bw: dict, eff: float, step: _Ledger) -> None:
    """All-reduce of gradients FSDP does not shard, the tied embedding's, and the optimizer."""
    replicas = {"dense": inp.sizes.dp * inp.sizes.cp, "expert": inp.sizes.expert_dp}
    work = optimizer_work(chunk, pl.shard_world["dense"], pl.shard_world["expert"], inp.optim,
                          in_backward=pl.in_backward)
    pcie, host, hbm = a.pcie_gb_s * 1e9, a.host_gb_s * 1e9, a.hbm_gb_s * 1e9
    for k in KINDS:
        g, w = replicas[k], work[k]
        if pl.shard_world[k] == 1 and g > 1:  # sync_gradients sums whole fp32 gradients
            step.move("dp comm", 2 * (g - 1) / g * (t[k]["numel"] - t[k]["frozen_numel"]) * MASTER,
                      bw[_group(k, inp)])
        if inp.pp > 1 and w["tied"]:  # first and last stage sum the embedding's gradient
            step.move("dp comm", w["tied"] * MASTER, bw["embedding"])
        if pl.host_masters:
            _split_traffic(w, pl.shard_world[k], bw[_group(k, inp)], step)
            _host_masters_step(w, inp, pcie, host, eff, step,
                               len({x.block for x in chunk.tensors if x.block is not None}), pl.in_backward)
            continue
        memory = host if pl.offloaded[k] else hbm
        step.seconds["optimizer"] += w["adamw"] * ADAMW_BYTES / memory
        if not w["matrix"]:
            continue
        step.seconds["optimizer"] += w["matrix"] * inp.optim.spec.step_bytes(inp.optim) / memory
        _orthogonalise(w, inp, eff, step)
        _split_traffic(w, pl.shard_world[k], bw[_group(k, inp)], step)
        if pl.offloaded[k]:  # gradient (or momentum) shard to the GPU, the update back
            step.move("host-device", 2 * w["matrix"] * MASTER, pcie, HD)


def _orthogonalise(w: dict, inp: PlanInputs, eff: float, step: _Ledger) -> None:
    """Newton-Schulz (or Dion's power iteration) on the GPU (what of it the in-backward steps'
    own stream hides is taken off in ``rank_work``: ``hidden_newton_schulz``)."""
    step.seconds["optimizer"] += w["flops"] / eff


def hidden_newton_schulz(cfg, chunk: ChunkShare, inp: PlanInputs, pl: Placement, eff: float, bw: dict) -> float:
    """Seconds of in-backward Newton-Schulz (``core/optim/in_backward.py``: its own CUDA stream)
    that fill the compute stream's waits for the backward's all-to-alls, walked block by block in
    the order the backward reaches them, with a backlog: work queued can fill only later waits.
    In an MoE block the rerun forward's dispatch and combine (less the shared expert hidden in
    the dispatch) and the combine's backward come before its expert gradients are final, the
    dispatch's backward after; matrices FSDP manages step after the block's reduce-scatter (in
    the next block's waits), the others when their gradient is accumulated; a row-sharded batch
    (``muon_split``) when its last matrix's hook closes it. Nothing after the last wait hides."""
    if not pl.in_backward or inp.optim.optimizer != "muon":
        return 0.0
    T, H, b = inp.tokens, cfg.hidden_size, inp.act_bytes
    a2a = T * cfg.num_experts_per_tok * H * b * (inp.ep - 1) / inp.ep / bw["ep"]
    moe, redone = _moe_blocks(cfg, chunk, inp)
    waits = block_waits(cfg, chunk, inp, moe, redone, T, eff, a2a)  # overlap.py

    mid: dict = {}   # block -> seconds queued inside its backward
    end: dict = {}   # block -> seconds queued after it (FSDP's post-reduce hooks)
    split: dict = {k: [] for k in KINDS}
    for s in sorted(chunk.tensors, key=_hook_order):
        if classify(s.spec, s.t, inp.optim.optimizer) != "matrix":
            continue
        kind = "expert" if s.expert else "dense"
        world = pl.shard_world[kind]
        if world > 1 and s.t.dim() == 2:
            split[kind].append(s)
            continue
        flops = ns_flops(s.t.shape, inp.optim.muon_ns_steps) / (world if s.t.dim() == 3 else 1)
        book = end if pl.managed[kind] else mid
        book[s.block] = book.get(s.block, 0.0) + flops / eff
    for kind, tensors in split.items():
        for closing, busiest in split_batches(tensors, pl.shard_world[kind], inp.optim.muon_ns_steps, True):
            end[closing.block] = end.get(closing.block, 0.0) + busiest / eff
    backlog = hidden = 0.0

    def wait(seconds):
        nonlocal backlog, hidden
        took = min(backlog, seconds)
        hidden, backlog = hidden + took, backlog - took

    for block in sorted({s.block for s in chunk.tensors}, key=_block_order):
        if block in moe and a2a:
            wait(waits[block].rerun + waits[block].combine_bwd)
        backlog += mid.get(block, 0.0)
        if block in moe and a2a:
            wait(waits[block].dispatch_bwd)
        backlog += end.get(block, 0.0)
    return hidden


NS_BYTES = 2  # Newton-Schulz runs in bf16: its rows travel in bf16 both ways (core/optim/muon_split.py)


def _split_traffic(w: dict, world: int, bytes_per_s: float, step: _Ledger) -> None:
    """Split Newton-Schulz's two all-to-alls: this rank's rows of each matrix to its owner, the
    update's rows back (all but the 1/D it owns itself), in Newton-Schulz's dtype."""
    if world > 1 and w["split"]:
        step.move("dp comm", (world - 1) / world * w["split"] * 2 * NS_BYTES, bytes_per_s)


def _host_masters_step(w: dict, inp: PlanInputs, pcie: float, host: float, eff: float, step: _Ledger,
                       units: int, in_backward: bool) -> None:
    """``cpu_offload="masters"`` (``core/optim/host_masters.py``), per kind: Muon's
    Newton-Schulz on the GPU; on worker threads each matrix's bf16 update to the host (2 bytes),
    its host update (fp32 master read and written, the update read, the new bf16 weight written:
    12 bytes) and the new weight back to the GPU (2 bytes), during the backward with
    ``optimizer_in_backward`` (else after it; what the last of the chunk's ``units`` blocks sends
    cannot start before the backward ends), counted one after the other; the AdamW parameters'
    bf16 gradients (2 bytes; made fp32 on the host) to the host, their AdamW (28 bytes + 2 for the
    new weight) after the clip, and their new bf16 weights back (2 bytes)."""
    _orthogonalise(w, inp, eff, step)
    matrix_s = w["matrix"] * (4 / pcie + 12 / host)
    step.bytes[HD] += 4 * w["matrix"]
    if in_backward:
        step.behind_backward += matrix_s
        step.tail += matrix_s / max(1, units)
    else:
        step.seconds["optimizer"] += matrix_s
    step.move("host-device", 2 * w["adamw"], pcie, HD)
    step.seconds["optimizer"] += w["adamw"] * (ADAMW_BYTES + 2) / host
    step.move("host-device", 2 * w["adamw"], pcie, HD)


def rank_work(cfg, chunks: list, inp: PlanInputs, a: TimeAssumptions, pl: Placement,
              peak: float, pp_rank: int) -> tuple[list, _Ledger]:
    """Per chunk the (forward, backward) ledgers of one micro-batch, and the rank's
    once-per-step ledger."""
    eff = a.assumed_mfu * peak * 1e12
    bw = _bandwidths(inp, a, pp_rank)
    passes, step = [], _Ledger()
    for chunk in chunks:
        t = chunk_tally(chunk, inp, pl)
        f, bk = _chunk_passes(cfg, chunk, inp, eff, bw)
        if pl.recompute_placement.offload_inputs:  # out on a stream of its own (bytes only), back on the compute stream
            kept = kept_inputs(cfg, chunk, inp)
            f.bytes[HD] += kept
            bk.move("host-device", kept, a.pcie_gb_s * 1e9, HD)
        _weights_and_gradients(t, inp, pl, bw, a.pcie_gb_s * 1e9, a.host_gb_s * 1e9, f, bk, step)
        _sync_and_optimizer(chunk, t, inp, a, pl, bw, eff, step)
        step.hidden_ns += hidden_newton_schulz(cfg, chunk, inp, pl, eff, bw)
        passes.append((f, bk))
    return passes, step


def plan_time(cfg, inp: PlanInputs, a: TimeAssumptions | None = None,
              peak: float | None = None, global_batch_size: int | None = None) -> StepTime:
    """The step-time prediction of a layout. ``global_batch_size`` in packs (default: micro-
    batches x micro-batch size x DP)."""
    a, peak, pl = a or TimeAssumptions(), peak_tflops(peak), placement(inp)
    shares = planned_shares(cfg, inp)
    S, M = inp.pp * inp.vpp, inp.num_microbatches
    fwd, bwd, work = [0.0] * S, [0.0] * S, []
    for r, chunks in enumerate(shares):
        passes, step = rank_work(cfg, chunks, inp, a, pl, peak, r)
        for chunk, (f, bk) in zip(chunks, passes):
            fwd[chunk.stage], bwd[chunk.stage] = f.total, bk.total
        work.append((passes, step))
    if inp.pp > 1:  # the executor's programs: bubble, stage imbalance, p2p ordering
        makespan = plan_makespan(schedule_facts(inp.pp, inp.vpp, M).programs, inp.pp, fwd, bwd)
    else:
        makespan = M * (fwd[0] + bwd[0])
    ranks = []
    for r, (passes, step) in enumerate(work):
        sec, moved = dict(step.seconds), dict(step.bytes)
        for ledger in (x for pair in passes for x in pair):
            for key in BREAKDOWN:
                sec[key] += M * ledger.seconds[key]
            for link in moved:
                moved[link] += M * ledger.bytes[link]
        sec["idle"] = makespan - M * sum(f.total + bk.total for f, bk in passes)
        # host work that overlaps the backward: only what outlasts the rank's backward shows
        sec["optimizer"] += max(step.tail, step.behind_backward - M * sum(bk.total for _, bk in passes))
        sec["optimizer"] -= step.hidden_ns  # in-backward Newton-Schulz in the all-to-all waits
        ranks.append(RankTime(r, sec, moved))
    slowest = max(ranks, key=lambda x: x.total)
    step_s, world = slowest.total, inp.sizes.world
    gbs = global_batch_size or M * inp.micro_batch_size * inp.dp
    # useful FLOPs: forward and backward once (no recompute); a LoRA run's backward has no weight
    # gradients of its frozen base, and its adapters' work is useful
    chunks_all = [c for chunks in shares for c in chunks]
    model_flops = 3 * sum(_stage_flops(cfg, c, inp)[0] for c in chunks_all) * inp.seq_length * gbs
    if inp.lora_rank:
        skipped, adapters = (sum(x) for x in zip(*(lora_flops(cfg, c, inp) for c in chunks_all)))
        model_flops += (3 * adapters - skipped) * inp.seq_length * gbs
    model_flops += vision_flops(cfg, inp).useful * inp.seq_length * gbs  # the image encoder's, once
    bubble = sum(x.seconds["idle"] for x in ranks) / (inp.pp * makespan) if makespan else 0.0
    return StepTime(ranks, step_s, slowest.pp_rank, makespan, bubble,
                    gbs * inp.seq_length / step_s / world, model_flops / (step_s * world * peak * 1e12),
                    peak, asdict(a))

"""Memory plan per rank, without allocating anything: each rank's share of the model is built on
the meta device for the real layout (every rank simulated in this one process), its tensors
counted, and activations taken from ``activations.py`` times the schedule's peak in-flight
micro-batches (from the pipeline simulator).

Parameters, gradients and optimizer state follow what this code allocates: parameters are
always fp32 (under ``bf16`` they are the master weights), gradients are fp32 (accumulated and
reduced so under ``bf16`` too), optimizer state in the parameter dtype (AdamW: two moments plus a
4-byte step per tensor; Muon: one buffer, none at momentum 0; Dion: a buffer and the n x r
factor). Activations, p2p and all-to-all buffers and gathered compute copies take the compute
dtype (2 bytes under ``bf16``). With ``sharding="fsdp"`` dense tensors are split over the
data-parallel ranks and expert tensors over the expert-data-parallel ranks (dim 0, padded like
FSDP2), and the largest layer is gathered whole while it computes (twice: one prefetched);
``bf16`` without sharding keeps a bf16 copy of the whole stage for the step. CPU offload moves the offloaded shards, their
gradients and optimizer state to host memory. Activations assume a fused attention kernel
(flash / flex / Transformer Engine: no score matrix).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from core.optim.build import classify
from core.parallel_state import ParallelSizes, ParallelState
from core.pipeline.p2p import max_live_buffers, plan_all
from core.pipeline.schedules import build_schedule
from core.pipeline.simulate import simulate
from models.step37.activations import head_bytes, layer_bytes
from models.step37.config import Step37Config
from models.step37.parallelize import build_chunks

GB = 10**9


@dataclass
class PlanInputs:
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    dp: int = 1
    sharding: str = "none"          # none | fsdp
    fsdp_gather_once: bool = False  # keep every layer of the stage gathered for the whole step
    cpu_offload: str = "none"       # none | all | experts
    recompute: str = "none"         # none | selective | full
    recompute_num_layers: int = 0   # first N layers of each chunk; 0: all
    seq_length: int = 8192
    micro_batch_size: int = 1
    num_microbatches: int = 8       # per pipeline per iteration
    optimizer: str = "muon"         # adamw | muon | dion
    muon_momentum: float = 0.0
    dion_rank_fraction: float = 0.25
    bf16: bool = False              # bf16 compute over fp32 master weights and gradients
    device_gb: float = 141.0
    pipeline_layout: str | None = None

    def __post_init__(self):
        for name, allowed in (("sharding", ("none", "fsdp")), ("cpu_offload", ("none", "all", "experts")),
                              ("recompute", ("none", "selective", "full")),
                              ("optimizer", ("adamw", "muon", "dion"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: expected one of "
                                 f"{', '.join(allowed)}")
        if self.cpu_offload != "none" and self.sharding != "fsdp":
            raise ValueError("--cpu-offload needs --data-parallel-sharding fsdp")


@dataclass
class RankMemory:
    pp_rank: int
    ep_rank: int
    parameters: int = 0                 # count, this rank's share
    device: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    fits: bool = True

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def _shard_numel(t: torch.Tensor, world: int) -> int:
    if world <= 1 or t.dim() == 0:
        return t.numel()
    return math.ceil(t.shape[0] / world) * (t.numel() // t.shape[0])


MASTER = 4  # parameters (the fp32 master under bf16), gradients and optimizer state


def _optimizer_bytes(spec, t: torch.Tensor, numel: int, inp: PlanInputs) -> int:
    kind = classify(spec, t, inp.optimizer)
    b = MASTER
    if kind != "matrix":
        return 2 * numel * b + 4  # AdamW moments + fp32 step counter
    if inp.optimizer == "muon":
        return numel * b if inp.muon_momentum > 0 else 0
    m, n = t.shape[-2], t.shape[-1]
    r = max(1, math.ceil(inp.dion_rank_fraction * min(m, n)))
    batch = t.numel() // (m * n)
    return numel * b + batch * n * r * b


def _rank_state(cfg: Step37Config, sizes: ParallelSizes, pp_rank: int, ep_rank: int, layout, seq_length):
    rank = sizes.rank_of(dp=ep_rank, pp=pp_rank)
    return build_chunks(cfg, ParallelState(sizes, rank, {}), layout, seq_length=seq_length, device="meta")


def plan(cfg: Step37Config, inp: PlanInputs) -> list[RankMemory]:
    world = inp.pp * inp.dp
    sizes = ParallelSizes(world, pp=inp.pp, ep=inp.ep, vpp=inp.vpp)
    sizes.validate(cfg.num_layers, cfg.num_experts)
    T, b, H = inp.seq_length * inp.micro_batch_size, 2 if inp.bf16 else 4, cfg.hidden_size
    fsdp = inp.sharding == "fsdp" and inp.dp > 1  # like apply_fsdp: nothing to shard at DP 1
    schedule = build_schedule(inp.pp, inp.vpp, inp.num_microbatches)
    sim = simulate(schedule)
    programs = plan_all(schedule) if inp.pp > 1 else {}
    out = []
    for pp_rank in range(inp.pp):
        for ep_rank in range(inp.ep):
            chunks = _rank_state(cfg, sizes, pp_rank, ep_rank, inp.pipeline_layout, inp.seq_length)
            r = RankMemory(pp_rank, ep_rank)
            dev = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "p2p buffers",
                                 "all-to-all buffers", "gathered layers"), 0)
            host = dict.fromkeys(("parameters", "gradients", "optimizer"), 0)
            largest_layer, all_layers = 0, 0
            for chunk in chunks:
                specs = chunk.param_specs()
                for name, t in chunk.named_parameters():
                    expert = specs[name].replicated_over == "expert_dp"
                    shard_world = (sizes.expert_dp if expert else sizes.dp) if fsdp else 1
                    numel = _shard_numel(t, shard_world)
                    r.parameters += numel
                    offloaded = inp.cpu_offload == "all" or (inp.cpu_offload == "experts" and expert)
                    where = host if offloaded else dev
                    where["parameters"] += numel * MASTER
                    where["gradients"] += numel * MASTER
                    where["optimizer"] += _optimizer_bytes(specs[name], t, numel, inp)
                if fsdp:
                    for layer in chunk.layers.values():
                        size = sum(p.numel() for p in layer.parameters()) * b
                        largest_layer, all_layers = max(largest_layer, size), all_layers + size
                elif inp.bf16:  # one-rank meshes: the stage's bf16 copy, kept for the step
                    all_layers += sum(p.numel() for p in chunk.parameters()) * b
                dev["activations"] += _chunk_activations(cfg, chunk, T, b, inp)
            # in-flight micro-batches: the simulator's peak for this rank, spread over its chunks
            dev["activations"] = dev["activations"] * sim.peak_in_flight[pp_rank] // len(chunks)
            if fsdp:
                dev["gathered layers"] = all_layers if inp.fsdp_gather_once else 2 * largest_layer
            elif inp.bf16:
                dev["gathered layers"] = all_layers
            if inp.pp > 1:  # messages received ahead of use and sent ones not yet retired
                S = inp.pp * inp.vpp
                dev["p2p buffers"] = max_live_buffers(programs[pp_rank], pp_rank, inp.pp, S, inputs=False) * T * H * b
            if inp.ep > 1:
                dev["all-to-all buffers"] = 4 * T * cfg.num_experts_per_tok * H * b
            r.device, r.host = dev, host
            r.fits = r.device_total <= inp.device_gb * GB
            out.append(r)
    return out


def _chunk_activations(cfg: Step37Config, chunk, T: int, b: int, inp: PlanInputs) -> int:
    total = 0
    for k, i in enumerate(chunk.layers):
        mode = inp.recompute if (inp.recompute_num_layers <= 0 or k < inp.recompute_num_layers) else "none"
        total += layer_bytes(cfg, int(i), T, b, mode)
    if not chunk.first:
        total += T * cfg.hidden_size * b  # the received hidden state waits for its gradient
    if chunk.last:
        total += head_bytes(cfg, T, b)
        for k in range(cfg.num_mtp_layers):
            total += layer_bytes(cfg, -1 - k, T, b, inp.recompute) + head_bytes(cfg, T, b) \
                + 3 * T * cfg.hidden_size * b  # shifted embedding, eh_proj input
    return total


def as_dict(ranks: list[RankMemory]) -> list[dict]:
    return [{**asdict(r), "device_total": r.device_total, "host_total": r.host_total} for r in ranks]


def format_table(ranks: list[RankMemory], inp: PlanInputs) -> str:
    cols = ["parameters", "gradients", "optimizer", "activations", "p2p buffers", "all-to-all buffers",
            "gathered layers"]
    short = ["params", "grads", "optim", "activ", "p2p", "a2a", "gathered"]
    head = f"{'rank':<10}{'params #':>14}" + "".join(f"{s:>10}" for s in short) + \
        f"{'device':>10}{'host':>10}  fits {inp.device_gb:g} GB"
    lines = ["all sizes in GB (1e9 bytes); device columns unless noted", head]
    for r in ranks:
        lines.append(f"pp{r.pp_rank} ep{r.ep_rank:<4}{r.parameters:>14,}" +
                     "".join(f"{r.device[c] / GB:>10.1f}" for c in cols) +
                     f"{r.device_total / GB:>10.1f}{r.host_total / GB:>10.1f}  {'yes' if r.fits else 'NO'}")
    return "\n".join(lines)

"""Search layouts for a world size: every pipeline size, virtual stages, context-parallel size
(for long sequences: shards of at least ``CP_MIN_TOKENS`` tokens), EP size, memory mode
(sharding, CPU offload, gather-once), recompute, micro-batch size and, under expert parallelism
when the flags given include ``--overlap-moe-expert-parallel-comm``, the all-to-alls overlapped
or not (``overlap.py``: a schedule not yet measured on a GPU, weighed when asked for), planned for
memory and predicted step time, those that fit ranked fastest first.

The model, sequence length, global batch (in packs), precision and optimizer stay as given;
layers split by cost (the trainer's default layout). Each (pp, vpp, ep) share is built once on
the meta device (``shares.py``); the rest is arithmetic, so a search over ~2,100 layouts of
Step-3.7-Flash takes seconds. Any registered model family: the shares and costs come from its
chunks and shapes.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from core.memory_mode import RECOMPUTE_MODES, SHARDING_MODES, MemoryMode, RunFacts

from training.planner.inputs import PlanInputs
from training.planner.memory import GB, placement, plan
from training.planner.overlap import FLAG, overlap_choices
from training.planner.timing import TimeAssumptions, peak_tflops, plan_time
from training.planner.vision import layout_for

MICRO_BATCH_SIZES = (1, 2, 4, 8)
# context parallelism is searched where each rank still holds this many tokens of a pack: below
# that the K/V exchanges cost more than the activations they save (8K packs never search CP)
CP_MIN_TOKENS = 8192
@dataclass
class Row:
    pp: int
    vpp: int
    ep: int
    dp: int
    cp: int
    mode: MemoryMode        # its memory flags (with the base's precision; ``flags`` leaves that out)
    micro_batch_size: int
    num_microbatches: int
    device_gb: float        # busiest rank
    host_gb_per_node: float  # busiest node
    weights_per_microbatch: bool  # offloaded weights copied host-to-device every pass
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    idle: float              # pipeline bubble and imbalance
    fits: bool
    pipeline_layout: str | None = None  # with images: the split that pays for the encoder on stage 0
    overlap_moe_expert_parallel_comm: bool = False  # all-to-alls of two chunks behind compute (overlap.py)

    def flags(self) -> str:
        """The training flags that select this layout (the precision and optimizer are the base's)."""
        out = [f"--pipeline-model-parallel-size {self.pp}", f"--expert-model-parallel-size {self.ep}"]
        if self.cp > 1:
            out.append(f"--context-parallel-size {self.cp}")
        if self.vpp > 1:
            out.append(f"--virtual-pipeline-model-parallel-size {self.vpp}")
        out += self.mode.flags(always=("data_parallel_sharding", "recompute_granularity"), skip=("bf16",))
        out.append(f"--micro-batch-size {self.micro_batch_size}")
        if self.pipeline_layout:
            out.append(f"--pipeline-layout {self.pipeline_layout}")
        if self.overlap_moe_expert_parallel_comm:
            out.append(FLAG)
        return " ".join(out)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_sizes(world_per_stage: int, seq_length: int) -> list[int]:
    """CP sizes to search: 1, and those dividing the ranks of a stage whose shards (an even
    number of chunks per document) keep at least ``CP_MIN_TOKENS`` tokens."""
    return [c for c in _divisors(world_per_stage)
            if c == 1 or (seq_length % (2 * c) == 0 and seq_length // c >= CP_MIN_TOKENS)]


def candidates(cfg, world: int, base: PlanInputs, global_batch_size: int) -> list[PlanInputs]:
    """Every distinct layout, on the plain all-to-all schedule (``search`` adds the overlapped
    twins): modes that would run identically are listed once (with one dense
    replica nothing shards, so fsdp without offload is plain, and offload puts units on one-rank
    meshes that are always gathered once per step)."""
    out = []
    for pp, cp in ((p, c) for p in _divisors(world) for c in cp_sizes(world // p, base.seq_length)):
        dp = world // (pp * cp)
        for vpp in ((1, 2) if pp > 1 else (1,)):
            if cfg.num_layers < pp * vpp:
                continue
            for ep in (e for e in _divisors(dp * cp) if (cfg.num_experts % e == 0 if cfg.num_experts else e == 1)):
                for mbs in MICRO_BATCH_SIZES:
                    if global_batch_size % (mbs * dp):
                        continue
                    M = global_batch_size // (mbs * dp)
                    if vpp > 1 and M % pp:
                        continue
                    for mode in memory_modes(base, dp * cp, mbs, cp, M):
                        out.append(replace(base, pp=pp, vpp=vpp, ep=ep, dp=dp, cp=cp, micro_batch_size=mbs,
                                           num_microbatches=M, pipeline_layout=None, mode=mode,
                                           overlap_moe_expert_parallel_comm=False))
    return out


def _recompute_modes(mbs: int, cp: int, M: int) -> list:
    """(granularity, chunks, offloaded inputs): each granularity as it is, and full recompute a
    pack at a time, with or without its inputs in host memory, where a rank runs one micro-batch
    of several packs per step without CP (with more micro-batches a smaller one does as well)."""
    out = [(rc, 1, False) for rc in RECOMPUTE_MODES]
    if mbs > 1 and cp == 1 and M == 1:
        out += [("full", mbs, False), ("full", mbs, True)]
    return out


# the order the search lists memory modes in (equally fast layouts keep it)
SEARCH_OFFLOAD_ORDER = ("none", "experts", "all", "optimizer", "masters")


def memory_modes(base: PlanInputs, replicas: int, mbs: int, cp: int, M: int) -> list[MemoryMode]:
    """Every memory mode of the table (``MemoryMode.every``, with the base's precision) that runs
    on this layout (``MemoryMode.check`` accepts it, with the base's optimizer and its options, as
    validation would), less those that would run like another one listed
    (``MemoryMode.runs_like_another``); recompute as ``_recompute_modes`` lists it."""
    facts = RunFacts.of(replicas // cp, cp, M, mbs, base.optim, compile=base.compile, lora=base.lora_rank > 0)
    return [mode for mode in _table_modes(base.mode.bf16, tuple(_recompute_modes(mbs, cp, M)))
            if not mode.runs_like_another(replicas) and mode.allows(facts)]


@lru_cache(maxsize=64)
def _table_modes(bf16: bool, recompute: tuple) -> tuple:
    """The table's modes at this precision whose recompute is one of ``recompute`` (granularity,
    chunks, offloaded inputs), in the order the search lists them (``SEARCH_OFFLOAD_ORDER``,
    sharding, gather-once, in-backward, remainders, then ``recompute``'s)."""
    modes = MemoryMode.every(bf16=bf16, recompute_num_layers=0,
                             recompute_chunks=tuple(sorted({c for _, c, _ in recompute})))
    rc = lambda m: (m.recompute_granularity, m.recompute_chunks, m.offload_recompute_inputs)
    order = lambda m: (SEARCH_OFFLOAD_ORDER.index(m.cpu_offload), SHARDING_MODES.index(m.data_parallel_sharding),
                       m.fsdp_gather_once, m.optimizer_in_backward, m.store_param_remainders, recompute.index(rc(m)))
    return tuple(sorted((m for m in modes if rc(m) in recompute), key=order))


# device memory a layout must leave free to rank as fitting: what the plan does not count (the
# CUDA context and NCCL's buffers, a few GB; the caching allocator's fragmentation, which grows
# with the memory in use; transient workspaces): 10 GB on an H200, 5.6 GB on an H100
RESERVE_SHARE = 0.07


def reserve_gb(device_gb: float, reserve: float | None = None) -> float:
    return RESERVE_SHARE * device_gb if reserve is None else reserve


def evaluate(cfg, inp: PlanInputs, a: TimeAssumptions, peak: float, global_batch_size: int,
             host_gb: float, reserve: float | None = None) -> Row:
    ranks = plan(cfg, inp)
    st = plan_time(cfg, inp, a, peak, global_batch_size)
    host_of = {r.pp_rank: r.host_total for r in ranks}
    nodes: dict = {}
    for rank in range(inp.sizes.world):
        node = rank // a.gpus_per_node
        nodes[node] = nodes.get(node, 0) + host_of[inp.sizes.coords(rank)["pp"]]
    device = max(r.device_total for r in ranks) / GB
    host = max(nodes.values()) / GB
    fits = device <= inp.device_gb - reserve_gb(inp.device_gb, reserve) and (host_gb <= 0 or host <= host_gb)
    return Row(inp.pp, inp.vpp, inp.ep, inp.dp, inp.cp, inp.mode,
               inp.micro_batch_size, inp.num_microbatches, device, host,
               placement(inp).copies_weights_per_microbatch(), st.step_s, st.tokens_per_s_per_gpu,
               st.mfu, st.bubble, fits, layout_for(cfg, inp), inp.overlap_moe_expert_parallel_comm)


def search(cfg, world: int, base: PlanInputs, global_batch_size: int,
           a: TimeAssumptions | None = None, peak: float | None = None, host_gb: float = 0.0,
           progress: bool = True, reserve: float | None = None) -> list[Row]:
    """Every candidate layout, those that fit first (``reserve`` GB left free, default
    ``RESERVE_SHARE`` of the device), fastest (tokens/s per GPU) first; with the overlap flag in
    ``base``, each EP layout that fits also with it (``overlap_choices``); among
    equally fast ones, unchunked recompute first, then the plain all-to-all schedule, then the one
    with the most device memory to spare."""
    from tqdm import tqdm

    a, peak = a or TimeAssumptions(), peak_tflops(peak)
    overlap = base.overlap_moe_expert_parallel_comm  # asked for: weigh both schedules (overlap.py)
    todo = candidates(cfg, world, base, global_batch_size)
    rows = []
    for inp in tqdm(todo, desc="planning layouts", unit="layout", disable=not progress):
        rows.append(evaluate(cfg, inp, a, peak, global_batch_size, host_gb, reserve))
        # the overlap needs more memory than the plain schedule and nothing else: listed where that fits
        if overlap and rows[-1].fits and True in overlap_choices(cfg, inp):
            rows.append(evaluate(cfg, replace(inp, overlap_moe_expert_parallel_comm=True), a, peak,
                                 global_batch_size, host_gb, reserve))
    # at equal predicted speed, unchunked recompute first, then the plain all-to-all schedule: chunks
    # and the overlap's halves cost what the prediction does not time (smaller GEMMs, more launches,
    # inner units gathered once per chunk in the forward)
    return sorted(rows, key=lambda r: (not r.fits, -round(r.tokens_per_s_per_gpu, 6), r.mode.recompute_chunks > 1,
                                       r.overlap_moe_expert_parallel_comm, r.device_gb))


HEAD = (f"{'#':>3} {'pp':>3}{'vpp':>4}{'ep':>4}{'dp':>4}{'cp':>4}  {'sharding':<9}{'offload':<10}{'once':<5}"
        f"{'recompute':<14}{'masters':<8}{'ovl':<4}{'mbs':>4}{'M':>4}{'GB/GPU':>8}{'host_GB/node':>13}{'weights/mb':>11}"
        f"{'step_s':>8}{'tokens/s/GPU':>13}{'MFU':>7}{'idle':>7}")


def format_rows(rows: list[Row], top: int) -> str:
    lines = [HEAD]
    for i, r in enumerate(rows[:top], 1):
        sharding, offload, once, recompute, masters = r.mode.short_words()
        ovl = "yes" if r.overlap_moe_expert_parallel_comm else "no"
        lines.append(f"{i:>3} {r.pp:>3}{r.vpp:>4}{r.ep:>4}{r.dp:>4}{r.cp:>4}  {sharding:<9}{offload:<10}"
                     f"{once:<5}{recompute:<14}{masters:<8}{ovl:<4}{r.micro_batch_size:>4}"
                     f"{r.num_microbatches:>4}{r.device_gb:>8.1f}{r.host_gb_per_node:>13.0f}"
                     f"{'yes' if r.weights_per_microbatch else 'no':>11}{r.step_s:>8.1f}"
                     f"{r.tokens_per_s_per_gpu:>13,.0f}{r.mfu:>7.1%}{r.idle:>7.1%}")
    return "\n".join(lines)


def _row_dict(r: Row) -> dict:
    """A row as JSON, flat: its memory flags under their own names (no ``pipeline_layout`` key
    where the trainer's default layout runs)."""
    d = asdict(r)
    d.update(d.pop("mode"))
    if d["pipeline_layout"] is None:
        del d["pipeline_layout"]
    return d


def report(rows: list[Row], world: int, device_gb: float, host_gb: float, a: TimeAssumptions, peak: float,
           top: int = 20, as_json: bool = False, prog: str = "plan_memory", reserve: float | None = None) -> int:
    """Print the ranked table (or every row as JSON); returns 0, or 1 when nothing fits."""
    fitting = [r for r in rows if r.fits]
    if as_json:
        print(json.dumps({"world_size": world, "device_gb": device_gb, "reserve_gb": reserve_gb(device_gb, reserve),
                          "host_gb_per_node": host_gb,
                          "peak_tflops": peak, "assumptions": asdict(a), "layouts": len(rows),
                          "fitting": len(fitting),
                          "rows": [{**_row_dict(r), "flags": r.flags()} for r in rows]}, indent=1))
        return 0 if fitting else 1
    limit = f" and {host_gb:g} GB of host memory per node" if host_gb > 0 else ""
    print(f"{len(fitting)} of {len(rows)} layouts on {world} GPUs fit {device_gb:g} GB per GPU with "
          f"{reserve_gb(device_gb, reserve):.1f} GB left free{limit}; "
          f"fastest first (predicted: {a.assumed_mfu:.0%} of {peak:g} TFLOP/s, PCIe {a.pcie_gb_s:g} GB/s, "
          f"NVLink {a.nvlink_gb_s:g} GB/s, host {a.host_gb_s:g} GB/s; host masters and in-backward Newton-Schulz overlap the backward)")
    if not fitting:
        print(f"{prog}: no layout fits; the closest by device memory:")
        print(format_rows(sorted(rows, key=lambda r: r.device_gb), min(top, 5)))
        return 1
    print(format_rows(fitting, top))
    print("once: --fsdp-gather-once; recompute full/4: --recompute-chunks 4, +off: --offload-recompute-inputs; masters: fp32, or rem (--store-param-remainders), +ib "
          "(--optimizer-in-backward); ovl: --overlap-moe-expert-parallel-comm; weights/mb: offloaded weights copied to the GPU for every "
          "micro-batch's forward and backward; M: micro-batches per pipeline; GB/GPU: the busiest "
          "rank; idle: pipeline bubble and stage imbalance")
    best = fitting[0]
    print(f"{prog}: fastest layout: {best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, step "
          f"{best.step_s:.1f} s, {best.device_gb:.1f} GB on the busiest GPU; its flags:\n  {best.flags()}")
    return 0

"""Trace one rank of the real world: the real build, ``parallelize`` and ``train_step`` on fake
tensors (``FakeTensorMode``: shapes and dtypes, no storage) in a fake process group (torch's
``FakeStore``, backend ``"fake"``: every collective returns at once), counting live bytes at
every allocation and free (``training/trace/counter.py``). Nothing of size is allocated.

What the trace assumes (docs/memory.md, "The traced peak"):

- the CPU stands in for the GPU (a CPU-only torch cannot make CUDA tensors, fake or not), and
  host memory is told from device memory by where the code puts it: host masters (their fp32
  masters, optimizer state and staging slab) and FSDP's offloaded shards (with their gradients
  and optimizer state) are host; everything else is device;
- the attention kernel is the GPU's (``--attention-backend auto`` with ``--bf16``: flash
  ``varlen``), not the CPU's per-document sdpa;
- every pack is one document of ``--seq-length`` tokens, every token a target, routing
  balanced over the experts (``core/distributed/host_values.py``), as the planner assumes;
- the step runs twice: the first creates the optimizer state, the second is measured;
- an async collective keeps its tensors until its ``wait()``, as NCCL's does (``works.py``; the
  fake group's ``Work`` holds nothing);
- ``--compile`` is refused (dynamo does not trace fake tensors made outside it).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from core.distributed import fsdp_internals
from core.distributed.grads import local
from core.optim.host_masters import HostMasters
from core.optim.masters import masters_of
from core.parallel_state import ParallelState
from core.train_step import train_step
from training.trace.batches import images_per_pack, trace_batches, with_images
from training.trace.counter import LiveBytes, storage_key
from training.trace.works import held_until_wait

COLUMNS = ("parameters", "gradients", "unsharded grads", "optimizer", "activations", "gathered layers")


@dataclass
class TraceResult:
    rank: int
    device_total: int                                 # peak live device bytes of the measured step
    device: dict = field(default_factory=dict)        # planner column -> bytes live at the peak
    host_total: int = 0                               # host bytes, the most held at once (masters,
                                                      # their state, offloaded shards, kept inputs)
    seconds: float = 0.0
    host_peak: int = 0                                # most host bytes the counter saw live (transients too)
    overfreed: int = 0                                # bytes freed that the counter never saw allocated

    def as_json(self) -> dict:
        return {"rank": self.rank, "traced_device_total": self.device_total, "traced_device": self.device,
                "traced_host_total": self.host_total, "trace_seconds": round(self.seconds, 1),
                "trace_overfreed": self.overfreed}


def refuse(args, layout) -> None:
    """``ValueError`` naming the flag for what the trace cannot run."""
    d = args.data
    if not args.memory.bf16:
        raise ValueError("--trace needs --bf16: torch's fake grouped GEMM (the experts') takes bf16 only; "
                         "trace the run's --bf16 twin")
    if images_per_pack(layout.config, getattr(args, "images", None), d.seq_length)[0] and layout.sizes.cp > 1:
        raise ValueError("--trace with --image-token-share and --context-parallel-size > 1 is not built: "
                         "trace the layout without images, or without context parallelism")
    if args.model.compile:
        raise ValueError("--trace does not run --compile (dynamo cannot trace the fake tensors a trace "
                         "makes): trace without --compile; compiled blocks keep the same tensors")


def trace_rank(args, layout, rank: int, *, progress=None, fake: bool = True) -> TraceResult:
    """Run one step of ``rank`` of ``layout``'s world on fake tensors (twice: the second is
    measured). Needs a process without a process group (it makes its own fake world and
    destroys it). ``fake=False``: the same on real tensors (a small model: the counter's check;
    the fake world's collectives move nothing, so only a world of one computes real values)."""
    refuse(args, layout)
    if dist.is_initialized():
        raise RuntimeError("--trace makes its own fake process group: run it in a process without one")
    t0 = time.perf_counter()
    args = _traced_args(args)
    cfg = layout.config
    if fake and cfg.attention_backend == "auto":  # --bf16 (refuse): the GPU's kernel, not the CPU's sdpa
        cfg = dataclasses.replace(cfg, attention_backend="varlen")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from training.parallelize import parallelize
    from training.trainer import step_parts

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.sizes.world)
    try:
        ps = ParallelState.build(layout.sizes, cfg.num_layers, cfg.num_experts)
        batches = trace_batches(cfg, args, ps, layout.num_microbatches)
        for kind in ("dp_cp", "expert_dp", "self"):  # FSDP's meshes, before any fake tensor
            if kind == "self" or ps.group(kind) is not None:
                ps.mesh(kind, "cpu")
        tick = progress or (lambda what: None)
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), held_until_wait():
            box = {}
            counter = LiveBytes(lambda: _classify(box))
            with counter:
                tick("build and parallelize")
                chunks = parallelize(cfg, ps, args)
                _inline_host_updates(chunks, counter)
                for block in (m for c in chunks for m in c.modules()):
                    if getattr(block, "chunked", None) is not None:  # inputs kept in host memory
                        block.chunked.host_observer = counter.mark_host
                optimizer, _, settings = step_parts(args, cfg, layout.spec, chunks, ps)
                box.update(chunks=chunks, optimizer=optimizer)
                counter.mark_host(_host_tensors(chunks, optimizer))
                batches = with_images(batches, cfg, getattr(args, "images", None), args.data.seq_length,
                                      torch.bfloat16)  # pixels as --bf16 gives them (refuse)
                tick("step 1 (optimizer state)")
                train_step(chunks, ps, optimizer, batches, settings)
                counter.mark_host(_host_tensors(chunks, optimizer))
                counter.reset_peak()
                tick("step 2 (measured)")
                train_step(chunks, ps, optimizer, batches, settings)
            # what stays in host memory, and the most the measured step held there at once
            # (inputs kept in host memory for the backward come and go)
            host = max(sum(_nbytes(t) for t in _unique(_host_tensors(chunks, optimizer))), counter.host_peak)
        device = {c: counter.at_peak.get(c, 0) for c in COLUMNS}
        return TraceResult(rank, counter.peak, device, host, time.perf_counter() - t0, counter.host_peak,
                           counter.overfreed)
    finally:
        dist.destroy_process_group()


class _Inline:
    """An executor that runs each job at once, on the calling thread, uncounted: a fake mode
    serves one thread, and host masters' updates are host work (``--cpu-offload masters``)."""

    def __init__(self, counter: LiveBytes):
        self.counter = counter

    def submit(self, fn, *a, **kw) -> Future:
        done = Future()
        with self.counter.paused():
            done.set_result(fn(*a, **kw))
        return done

    def shutdown(self, wait: bool = True) -> None:
        pass


def _inline_host_updates(chunks, counter: LiveBytes) -> None:
    masters = masters_of(chunks)
    if isinstance(masters, HostMasters):
        masters.pool.shutdown(wait=True)
        masters.pool = _Inline(counter)


def _traced_args(args):
    """The flags with what a trace does not do switched off: no weights read, no checkpoint."""
    args = copy.deepcopy(args)
    args.model.load_hf = None
    return args


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _unique(tensors) -> list:
    seen, out = set(), []
    for t in tensors:
        k = storage_key(t)
        if k not in seen:
            seen.add(k)
            out.append(t)
    return out


def _host_params(chunks) -> list:
    """Parameters whose stored values live in host memory: FSDP's offloaded shards."""
    out = []
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, fsdp_internals.FSDPModule):
                out += fsdp_internals.offloaded_shards(m)
    return out


def _host_tensors(chunks, optimizer) -> list:
    """Every tensor the code keeps in host memory on a GPU run."""
    out = []
    masters = masters_of(chunks)
    host_params = _host_params(chunks)
    ids = {id(p) for p in host_params}
    if isinstance(masters, HostMasters):
        out += list(masters.host.values())
        if masters.slab is not None:
            out.append(masters.slab)
        ids |= {id(p) for p in masters.host}
    for p in host_params:
        out.append(local(p))
        if p.grad is not None:
            out.append(local(p.grad))
    for opt in optimizer.optimizers.values():
        for p, st in opt.state.items():
            if id(p) in ids:
                out += [local(t) for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    return out


def _classify(box: dict) -> dict:
    """Storage key -> planner column for what the trace can name (the rest: activations)."""
    chunks, optimizer = box.get("chunks"), box.get("optimizer")
    if chunks is None:
        return {}
    names = {}

    def put(t, column):
        if t is not None:  # a DTensor's local shard without an op (this runs between ops)
            names.setdefault(storage_key(getattr(t, "_local_tensor", t)), column)

    for chunk in chunks:  # FSDP's gathered copies first: the modules hold them while gathered
        for m in chunk.modules():
            if isinstance(m, fsdp_internals.FSDPModule):
                for fp in fsdp_internals.fsdp_params(m):
                    shard = fsdp_internals.sharded_param(fp)
                    put(shard.grad, "gradients")
                    put(shard, "parameters")
                    u = fsdp_internals.unsharded_param(fp)
                    if u is not None and u.untyped_storage().nbytes():
                        put(getattr(u, "grad", None), "unsharded grads")
                        put(u, "gathered layers")
        for p in chunk.parameters():
            put(p.grad, "gradients")
            put(p, "parameters")
        for b in chunk.buffers():
            put(b, "parameters")
    if optimizer is not None:
        for opt in optimizer.optimizers.values():
            for st in opt.state.values():
                for t in st.values():
                    if torch.is_tensor(t) and t.dim() > 0:
                        put(t, "optimizer")
    remainders = getattr(masters_of(chunks), "rem", None)
    for t in (remainders or {}).values():
        put(t, "parameters")
    return names

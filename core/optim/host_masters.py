"""``--cpu-offload masters``: fp32 masters and optimizer state in host memory, bf16 compute weights
resident on the GPU, and the host's updates running while the backward goes on.

| on the GPU, per parameter | in host memory, per parameter |
| --- | --- |
| 2 bf16 weight (the only copy there) + its gradient while it waits | 4 fp32 master (pageable) + optimizer state (AdamW 8, Muon 0 at momentum 0, pageable) + 2 pinned staging: the update in, then the new weight out |

Only the staging is ever copied, so only it is pinned: one slab per rank (``pin()``, one
allocation, timed for the start-up log) sliced into one slot per parameter of 2 bytes an element
(+ ``SLOT_EXTRA`` bytes for the update's scalars), what the planner books
(``training/planner/memory.py``). Pinning each tensor on its own, as before, had torch's pinned
allocator round every block up to a power of two: about 1.4x the bytes booked, all of them
pinned at start-up.

Per step: each finished update (Muon: the orthogonalised gradient, computed on the GPU in the
backward; AdamW: the bf16 gradient and its clip factor, made fp32 on the host as the GPU would)
is copied into the parameter's slot on a copy stream of its own, never blocking the autograd
thread; a worker thread waits for that copy, updates the fp32 master in place, writes its bf16
rounding (round to nearest even, as ``--bf16``'s cast) over the same slot (the update is spent)
and copies it to the GPU on a second stream (host to device), after an event the autograd thread
recorded when the gradient was final: the weight's last use of the step is queued before it, and
the device copy is overwritten only after that. The next step's copy into the slot is queued
behind the compute stream, which waited for this one (``finish``). An input wider than the slot
(Muon with fp32 Newton-Schulz: a 4-byte update) is pinned on its own as before, with a warning.

Threads: torch's intra-op thread count is one per process, and every worker's ops use it; with
``cores`` (the rank's share of the machine), one core stays with the thread that launches the
backward's kernels and workers x intra-op threads fill the rest (``thread_plan``). So with
``--optimizer-in-backward`` Muon's new weights cross PCIe while the backward goes on;
``finish()`` (end of the step) waits for the workers and makes the compute stream wait for the
host-to-device stream before the next forward. One micro-batch per rank and step
(``train_args`` refuses more): with several, each micro-batch's bf16 gradients would have to
reach fp32 host accumulators, and Muon's whole accumulated gradient come back to the GPU for
Newton-Schulz (not built).

On a machine without CUDA every copy is a plain one and the workers still run in threads: the
arithmetic, and so every value, is the same.
"""
from __future__ import annotations

import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

from core.distributed.grads import local

WORKERS = 4       # most host threads per rank for the updates (each one a torch op: the GIL is released)
STAGING = 2       # pinned bytes per element: the bf16 update in, then the new bf16 weight out
SLOT_EXTRA = 16   # pinned bytes after each slot: the update's scalars (Muon's finite flag, AdamW's clip factor)


def _pinned_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu", pin_memory=torch.cuda.is_available())


def _pinned_bytes(n: int) -> torch.Tensor:
    """The rank's staging slab: ``n`` bytes, pinned where CUDA is (plain memory without it)."""
    return torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=torch.cuda.is_available())


def _align(n: int, to: int = 16) -> int:
    return -(-n // to) * to


def slot_bytes(numel: int) -> int:
    """One parameter's share of the slab: its bf16 elements, aligned, and the scalars' bytes."""
    return _align(STAGING * numel) + SLOT_EXTRA


def thread_plan(cores: int, workers: int = WORKERS) -> tuple[int, int]:
    """(worker threads, intra-op threads) for a rank with ``cores`` cores: one stays with the
    thread that launches the backward's kernels, the workers share the rest."""
    spare = max(1, cores - 1)
    w = max(1, min(workers, spare))
    return w, max(1, spare // w)


class HostMasters:
    def __init__(self, params=(), workers: int = WORKERS, cores: int | None = None):
        """``cores``: the rank's share of the machine's cores; given, the workers and torch's
        intra-op threads are sized to it (``thread_plan``; torch's count is the process's)."""
        self.host: dict = {}     # p -> fp32 master, this rank's rows, pageable host memory
        self.staged: dict = {}   # p -> its slot of the slab as bf16: the new compute value (after ``pin``)
        self.slots: dict = {}    # p -> (byte offset in the slab, bytes)
        self.slab, self.slab_bytes, self.pin_seconds = None, 0, None
        self.pending: list[Future] = []
        self.dirty: set = set()
        self.cores = cores
        if cores is not None:
            workers, threads = thread_plan(cores, workers)
            torch.set_num_threads(threads)
        self.workers = workers
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="host-masters")
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None  # device to host
        self.h2d = torch.cuda.Stream() if torch.cuda.is_available() else None     # host to device
        self._warned = False
        self.add(params)

    def add(self, params) -> None:
        for p in params:
            if p.dtype == torch.bfloat16 and p not in self.host:
                if self.slab is not None:
                    raise RuntimeError("HostMasters.add: the staging slab is already pinned; add every "
                                       "parameter before the first update (or pin())")
                self.host[p] = torch.empty(local(p).shape, dtype=torch.float32, device="cpu")
                n = slot_bytes(local(p).numel())
                self.slots[p] = (self.slab_bytes, n)
                self.slab_bytes += n

    def pin(self) -> float:
        """Allocate the staging slab (once; the first update or ``fp32`` does it otherwise) and
        slice it into each parameter's slot; the seconds it took."""
        if self.slab is not None:
            return self.pin_seconds
        t0 = time.perf_counter()
        self.slab = _pinned_bytes(self.slab_bytes)
        for p, (offset, _) in self.slots.items():
            t = local(p)
            self.staged[p] = self.slab[offset:offset + STAGING * t.numel()].view(torch.bfloat16).view(t.shape)
        self.pin_seconds = time.perf_counter() - t0
        return self.pin_seconds

    def describe(self) -> str:
        """One start-up line: where the bytes are, the pinning time, the threads."""
        gib = lambda n: f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"  # noqa: E731
        masters = sum(t.numel() * t.element_size() for t in self.host.values())
        pinned = "pinned" if torch.cuda.is_available() else "(no CUDA: not pinned)"
        threads = f"{self.workers} update workers x {torch.get_num_threads()} intra-op threads"
        return (f"host masters: {gib(masters)} fp32 masters in pageable memory; staging slab {gib(self.slab_bytes)} "
                f"{pinned} in {self.pin() or 0:.2f} s (one allocation, {len(self.slots)} slots); {threads}"
                + (f" on {self.cores} cores (one kept for the kernel launches)" if self.cores else ""))

    def __contains__(self, p) -> bool:
        return p in self.host

    # ------------------------------------------------------------------ the masters interface
    def master(self, p) -> torch.Tensor:
        """The live fp32 master of ``p`` (host memory)."""
        return self.host[p] if p in self.host else local(p).detach()

    def state_device(self, p) -> torch.device:
        return torch.device("cpu") if p in self.host else local(p).device

    @torch.no_grad()
    def set_master(self, p, value: torch.Tensor) -> None:
        """Store ``value`` (fp32) as ``p``'s master and its bf16 rounding on the device, now."""
        if p not in self.host:
            local(p).copy_(value)
            return
        self.host[p].copy_(value)
        local(p).copy_(self.host[p].to(torch.bfloat16))

    @contextmanager
    def fp32(self, p):
        """A synchronous update of ``p``'s master (``update`` is the asynchronous one)."""
        yield self.master(p)
        if p in self.host:
            self.pin()
            self.staged[p].copy_(self.host[p])
            self.dirty.add(p)

    def update(self, p, fn, *inputs) -> None:
        """``fn(master, *inputs)`` on a worker thread, the inputs copied to pinned host memory on
        the copy stream first; the new bf16 weight is staged for ``finish``."""
        if p not in self.host:
            with torch.no_grad():
                fn(local(p), *[x.to(local(p).device) for x in inputs])
            return
        host_inputs, event = self._to_host(p, inputs)
        # the device weight's last use this step is behind us (its gradient is final): the new
        # value may overwrite it once the work queued so far has run
        used = torch.cuda.current_stream().record_event() if self.h2d is not None else None

        def job():
            if event is not None:
                event.synchronize()
            with torch.no_grad():
                fn(self.host[p], *host_inputs)
                self.staged[p].copy_(self.host[p])  # round to nearest even
                self._to_device(p, used)
        self.pending.append(self.pool.submit(job))

    def _to_device(self, p, used) -> None:
        """The new bf16 weight to the device (a worker thread: on the host-to-device stream, after
        the weight's last use; ``finish`` makes the compute stream wait for that stream)."""
        if self.h2d is None:
            local(p).copy_(self.staged[p])
            return
        # a worker thread's current device is 0 whatever the rank's: name it, or leaving the
        # stream context would set (and create a context on) device 0
        with torch.cuda.device(self.h2d.device), torch.cuda.stream(self.h2d):
            self.h2d.wait_event(used)
            local(p).copy_(self.staged[p], non_blocking=True)

    def wait(self) -> None:
        """Every update submitted so far has run (a worker's error raises here)."""
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()

    def finish(self) -> None:
        """End of step: wait for the workers (each copied its new bf16 weights to the device as it
        finished them, Muon's while the backward still ran), copy those set synchronously
        (``fp32``), and make the compute stream wait for every copy before the next forward."""
        self.wait()
        with torch.no_grad():
            for p in self.dirty:
                self._to_device(p, torch.cuda.current_stream().record_event() if self.h2d is not None else None)
        self.dirty = set()
        if self.h2d is not None:
            torch.cuda.current_stream().wait_stream(self.h2d)

    def _places(self, p, inputs) -> list:
        """Where each input goes: a view of ``p``'s slot (packed in order, each aligned to its
        element size), or a pinned tensor of its own when the slot has no room for it."""
        self.pin()
        start, size = self.slots[p]
        cursor, out = start, []
        for x in inputs:
            nbytes = x.numel() * x.element_size()
            at = _align(cursor, x.element_size())
            if at + nbytes <= start + size:
                out.append(self.slab[at:at + nbytes].view(x.dtype).view(x.shape))
                cursor = at + nbytes
            else:
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"host masters: an update input of {x.dtype} x {tuple(x.shape)} does not fit "
                                  f"its parameter's {size}-byte staging slot (inputs wider than bf16, e.g. "
                                  "fp32 Newton-Schulz): it is pinned on its own, beyond the planned staging")
                out.append(_pinned_like(x))
        return out

    def _to_host(self, p, inputs) -> tuple[list, object]:
        """Copies of the inputs in ``p``'s slot of the pinned slab, and the event their copies
        complete on (None when they are done already: no CUDA, or host tensors)."""
        out = self._places(p, inputs)
        if self.stream is None or all(x.device.type == "cpu" for x in inputs):
            for o, x in zip(out, inputs):
                o.copy_(x.detach())
            return out, None
        # the inputs were computed there; and the slot's last copy to the device (the previous
        # step's new weight) is behind the compute stream since ``finish``
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for o, x in zip(out, inputs):
                x = x.detach()
                o.copy_(x, non_blocking=True)
                x.record_stream(self.stream)  # the source is not reused before the copy ends
            event = self.stream.record_event()
        return out, event

    def bytes(self) -> int:
        """Host bytes: the fp32 masters and the staging slab."""
        return sum(t.numel() * t.element_size() for t in self.host.values()) + self.slab_bytes


def zeros_like_on(p, device) -> torch.Tensor:
    """fp32 zeros shaped and sharded like ``p`` with this rank's part on ``device`` (where the
    parameter's master lives: its optimizer state goes there too)."""
    if isinstance(p, DTensor):
        if local(p).device == torch.device(device):
            return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        z = torch.zeros(local(p).shape, dtype=torch.float32, device=device)
        return DTensor.from_local(z, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format, device=device)

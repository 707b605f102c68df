"""``--cpu-offload masters``: fp32 masters and optimizer state in host memory, bf16 compute weights
resident on the GPU, and the host's updates running while the backward goes on.

| on the GPU, per parameter | in host memory, per parameter |
| --- | --- |
| 2 bf16 weight (the only copy there) + its gradient while it waits | 4 fp32 master + optimizer state (AdamW 8, Muon 0 at momentum 0) + 2 pinned staging for the update in + 2 for the new weight out |

Per step: each finished update (Muon: the orthogonalised gradient, computed on the GPU in the
backward; AdamW: the clipped gradient after it) is copied to pinned host memory on a copy stream
of its own, never blocking the autograd thread; a worker thread waits for that copy, updates the
fp32 master in place, writes its bf16 rounding (round to nearest even, as ``--bf16``'s cast) into
pinned staging and copies it to the GPU on a second stream (host to device), after an event the
autograd thread recorded when the gradient was final: the weight's last use of the step is
queued before it, and the device copy is overwritten only after that. So with
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

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

from core.distributed.grads import local

WORKERS = 4  # host threads per rank for the updates (each one a torch op: the GIL is released)


def _pinned_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu", pin_memory=torch.cuda.is_available())


class HostMasters:
    def __init__(self, params=(), workers: int = WORKERS):
        self.host: dict = {}     # p -> fp32 master, this rank's rows, host memory
        self.staged: dict = {}   # p -> bf16 new compute value, pinned
        self.pending: list[Future] = []
        self.dirty: set = set()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="host-masters")
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None  # device to host
        self.h2d = torch.cuda.Stream() if torch.cuda.is_available() else None     # host to device
        self.add(params)

    def add(self, params) -> None:
        for p in params:
            if p.dtype == torch.bfloat16 and p not in self.host:
                self.host[p] = _pinned_like(local(p), torch.float32)
                self.staged[p] = _pinned_like(local(p))

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
            self.staged[p].copy_(self.host[p])
            self.dirty.add(p)

    def update(self, p, fn, *inputs) -> None:
        """``fn(master, *inputs)`` on a worker thread, the inputs copied to pinned host memory on
        the copy stream first; the new bf16 weight is staged for ``finish``."""
        if p not in self.host:
            with torch.no_grad():
                fn(local(p), *[x.to(local(p).device) for x in inputs])
            return
        host_inputs, event = self._to_host(inputs)
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
        with torch.cuda.stream(self.h2d):
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

    def _to_host(self, inputs) -> tuple[list, object]:
        """Copies of the inputs in pinned host memory, and the event their copies complete on
        (None when they are done already: no CUDA, or host tensors)."""
        if self.stream is None or all(x.device.type == "cpu" for x in inputs):
            return [x.detach().cpu() if x.device.type != "cpu" else x.detach().clone() for x in inputs], None
        self.stream.wait_stream(torch.cuda.current_stream())  # the inputs were computed there
        with torch.cuda.stream(self.stream):
            out = []
            for x in inputs:
                x = x.detach()
                pinned = _pinned_like(x)
                pinned.copy_(x, non_blocking=True)
                x.record_stream(self.stream)  # the source is not reused before the copy ends
                out.append(pinned)
            event = self.stream.record_event()
        return out, event

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.host, self.staged) for t in d.values())


def zeros_like_on(p, device) -> torch.Tensor:
    """fp32 zeros shaped and sharded like ``p`` with this rank's part on ``device`` (where the
    parameter's master lives: its optimizer state goes there too)."""
    if isinstance(p, DTensor):
        if local(p).device == torch.device(device):
            return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        z = torch.zeros(local(p).shape, dtype=torch.float32, device=device)
        return DTensor.from_local(z, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format, device=device)

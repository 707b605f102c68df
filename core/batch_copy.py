"""A step's micro-batches on their way to the device: pinned on the host, copied ahead.

A micro-batch is a tree of dataclasses (``THDBatch`` -> ``PackedSeqParams`` -> ``CPShard``,
``ImageInputs``) whose leaves are tensors; :func:`map_tensors` walks it. The data loader's
workers hand batches over in pinned (page-locked) host memory (:func:`pin`, only when CUDA is
available: pinning is for DMA to a GPU, and on a CPU-only host it would only cost a copy).

:class:`DeviceBatches` copies a step's micro-batches to a CUDA device with non-blocking copies
issued on a side stream at the start of the step, one event per micro-batch; the compute stream
waits for micro-batch ``m``'s event only when the pipeline first asks for ``m``, so later
micro-batches cross PCIe while the first ones compute. Each copied tensor is marked as used by
the compute stream (``record_stream``), so the caching allocator does not hand its memory to the
side stream again before the compute that reads it is done. A pinned source stays valid until
its copy ends: torch's pinned-memory allocator holds a freed pinned block until the events of
the copies that read it have completed. On the CPU (and for any non-CUDA device) the batches
are plain ``.to(device)`` calls, as before.
"""
from __future__ import annotations

import dataclasses
import functools

import torch


def map_tensors(obj, fn):
    """``obj`` with every tensor ``t`` of its dataclass / list / tuple tree replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    return obj


def tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor of ``obj``'s tree (see :func:`map_tensors`)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) if f.init for t in tensors_of(getattr(obj, f.name))]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in tensors_of(x)]
    return []


def pin(obj):
    """``obj`` with its tensors in pinned host memory when CUDA is available; else ``obj``."""
    return map_tensors(obj, torch.Tensor.pin_memory) if torch.cuda.is_available() else obj


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per device for the whole run: the caching allocator reuses a freed block
    only on the stream it was allocated on, and ``torch.cuda.Stream()`` hands out the next of a
    rotating pool, so a new stream per step would keep up to a pool's worth of steps' batches
    reserved (and could share a stream with the host masters' copies)."""
    return torch.cuda.Stream(device)


class DeviceBatches:
    """``get(m)``: micro-batch ``m`` on ``device`` (module docstring)."""

    def __init__(self, batches: list, device):
        device = torch.device(device)
        if device.type != "cuda":
            self.batches, self.events = [b.to(device) for b in batches], None
            return
        main, side = torch.cuda.current_stream(device), _side_stream(device)
        self.batches, self.events = [], []
        with torch.cuda.stream(side):
            for b in batches:
                self.batches.append(b.to(device, non_blocking=True))
                self.events.append(side.record_event())
        for b in self.batches:
            for t in tensors_of(b):
                t.record_stream(main)
        self.main, self.waited = main, set()

    def __len__(self) -> int:
        return len(self.batches)

    def get(self, m: int):
        if self.events is not None and m not in self.waited:
            self.main.wait_event(self.events[m])
            self.waited.add(m)
        return self.batches[m]

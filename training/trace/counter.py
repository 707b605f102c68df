"""Live bytes of every tensor storage, at every allocation and free: the trace's one counter.

A ``TorchDispatchMode`` sees each op's outputs; a storage not seen before is counted with its
``nbytes`` and a ``weakref.finalize`` on it (torch keeps one Python object per storage, so the
finalizer runs when the storage itself dies, not a wrapper). FSDP2 allocates and frees its
gathered parameters by ``UntypedStorage.resize_`` (no op goes through dispatch), so while the
counter is entered that method is wrapped to count the change (restored on exit). The same
counter runs on real and on fake tensors (``FakeTensorMode``): fake storages have the sizes
real ones would, so a traced step and a real one count the same bytes.

Bytes are split in two: ``host`` storages (``mark_host``: what the code keeps in host memory
on a GPU run, see ``training/trace/runner.py``) and the rest, the device's. The device peak is
tracked exactly; what was live at it is read once the peak is passed (at the next free), by a
``classify`` callable that names the storages it knows (parameters, gradients, optimizer
state, ...): the rest are activations and temporaries."""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (its StorageImpl), stable while the storage lives; a
    DTensor's: its local shard's."""
    return getattr(t, "_local_tensor", t).untyped_storage()._cdata


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as c: ...``: ``c.peak`` (device bytes), ``c.at_peak`` (category ->
    bytes at the peak), ``c.host_peak``, ``c.device_now``."""

    def __init__(self, classify=None):
        super().__init__()
        self.classify = classify or (lambda: {})
        self.live: dict[int, int] = {}   # storage key -> bytes
        self.host: set[int] = set()
        self.device_now = self.host_now = 0
        self.peak = self.host_peak = 0
        self.at_peak: dict[str, int] = {}
        self._pending = False           # a new peak not yet passed
        self._snapshot = None           # what was live at the last peak passed, not yet named
        self._resize = None
        self._paused = False
        self._last = None               # the storage that grew last
        self.overfreed = 0              # bytes freed that were never counted as allocated: a storage
                                        # resized up behind the counter's back (the trace is then short)

    # ------------------------------------------------------------------ counting
    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage if it is new (a tensor made outside the mode, say); a wrapper
        subclass (a DTensor) by the tensors it wraps (its own storage holds nothing)."""
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self.track(inner)
            return
        s = t.untyped_storage()
        key = s._cdata
        if key in self.live:
            return
        self.live[key] = 0
        weakref.finalize(s, self._freed, key)
        self._grow(key, s.nbytes())

    def mark_host(self, tensors) -> None:
        """Count these tensors' storages as host memory from now on (and not in a device peak
        that their own allocation, the last one, made)."""
        for t in tensors:
            t = getattr(t, "_local_tensor", t)
            self.track(t)
            key = storage_key(t)
            if key not in self.host:
                self.host.add(key)
                n = self.live[key]
                if self._pending and key == self._last and self.peak == self.device_now:
                    self.peak -= n
                self.device_now -= n
                self.host_now += n
        self.host_peak = max(self.host_peak, self.host_now)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (the measured step)."""
        self.peak, self.host_peak, self.at_peak = self.device_now, self.host_now, {}
        self._pending, self._snapshot = True, None
        self._settle()
        self._name()

    def _grow(self, key: int, delta: int) -> None:
        if delta < 0:
            self._settle()  # a peak just passed: break it down before it changes
        self.live[key] += delta
        if self.live[key] < 0:  # freed more than it was counted: count no less than nothing
            self.overfreed -= self.live[key]
            delta -= self.live[key]
            self.live[key] = 0
        self._last = key
        if key in self.host:
            self.host_now += delta
            self.host_peak = max(self.host_peak, self.host_now)
            return
        self.device_now += delta
        if self.device_now > self.peak:
            self.peak, self._pending = self.device_now, True

    def _freed(self, key: int) -> None:
        n = self.live.get(key)
        if n is None:
            return
        self._grow(key, -n)
        del self.live[key]
        self.host.discard(key)

    def _settle(self) -> None:
        """A peak just passed: keep what was live at it (pure Python: this may run inside a
        finalizer, in the middle of any torch call); ``_name`` breaks it down later."""
        if not self._pending:
            return
        self._pending = False
        self._snapshot = {k: n for k, n in self.live.items() if n and k not in self.host}

    def _name(self) -> None:
        """Break the last peak's snapshot down by column (at a safe point: between ops)."""
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None:
            return
        names = self.classify()
        out: dict[str, int] = {}
        for key, n in snapshot.items():
            c = names.get(key, "activations")
            out[c] = out.get(c, 0) + n
        self.at_peak = out

    # ------------------------------------------------------------------ the mode
    @contextlib.contextmanager
    def paused(self):
        """Allocations made inside are not counted (host work run inline by the trace)."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._name()
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def __enter__(self):
        counter, resize = self, torch.UntypedStorage.resize_
        self._resize = resize

        def counted_resize(storage, size):
            key = storage._cdata
            before = storage.nbytes()
            out = resize(storage, size)
            if key in counter.live:
                counter._grow(key, storage.nbytes() - before)
            elif storage.nbytes():
                counter.live[key] = 0
                weakref.finalize(storage, counter._freed, key)
                counter._grow(key, storage.nbytes())
            return out

        torch.UntypedStorage.resize_ = counted_resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        self._settle()
        self._name()
        return super().__exit__(*exc)

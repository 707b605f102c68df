"""The trainer's micro-batches, built ahead by worker processes (``--num-workers``).

``THDLoader.micro_batch(m)`` is a pure function of ``m`` and the opened datasets, so the stream
is an index-based dataset of micro-batch numbers: torch's ``DataLoader`` over it, with a sampler
counting up from the loader's position, builds micro-batches ``consumed, consumed + 1, ...`` in
``num_workers`` processes (pack lookup, token and loss-mask reads, THD metadata, image decode and
preprocessing, the pixels' cast) and hands them back in order, in pinned memory when CUDA is
available (the copy to the GPU is then non-blocking: ``core/batch_copy.py``). The batches are
the same objects, bit for bit, as the training thread would build: same function, same inputs.

The loader's state stays what it was: micro-batches handed to the trainer (not those built
ahead), so a checkpoint saved with workers resumes exactly, with or without them. A resume
moves the position; the next micro-batch asked for then starts the workers at the new one.

Choices, and why:

* ``fork`` start method: a worker inherits the opened datasets (memory maps, image stores,
  processors) instead of unpickling them, and starts in milliseconds. Workers never touch CUDA
  (pinning happens in the main process's pin thread), which is what makes forking a CUDA
  process safe; the default start method of newer Pythons (``forkserver``) would have to
  pickle every dataset.
* one DataLoader iterator for the whole run (the sampler never ends): the workers start once,
  at the first micro-batch, and live until the run ends (``persistent_workers`` has nothing to
  keep: there is no second epoch to iterate).
* a generator of its own for the DataLoader's worker seeds, so starting the workers draws
  nothing from torch's global random state (which checkpoints save and restore).
* workers ignore SIGTERM: a scheduler's SIGTERM to the whole job must reach the trainer, which
  finishes its step and saves, not kill the workers under it; they end with the trainer.
* failures end the run with one line, never a hang: an exception in a worker is sent back and
  raised on the training thread as it is (the same error, naming the file and row, that
  ``--num-workers 0`` gives); a worker that dies (killed, out of memory) is found when the
  next micro-batch is asked for (a poll of the workers, then the same poll and torch's
  liveness check every ``POLL_S`` seconds while waiting), and a worker that hangs by the
  loader's timeout: both a one-line :class:`LoaderWorkerError` naming the worker. Torch's SIGCHLD handler, which would raise
  the same news asynchronously in whatever the training thread is doing (halfway through a
  checkpoint write, say), is not given the workers' pids.
"""
from __future__ import annotations

import itertools
import pickle
import signal
import time

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils import signal_handling as _signal_handling

WORKER_TIMEOUT_S = 600  # the longest a micro-batch may take to arrive before the run stops
POLL_S = 5              # how often a wait checks that the workers are alive
PREFETCH_FACTOR = 2     # micro-batches built ahead per worker


class LoaderWorkerError(RuntimeError):
    """A data-loader worker died or stopped answering (one line, naming it)."""


class _Failed:
    """An exception raised in a worker, carried back to be raised on the training thread."""

    def __init__(self, error: BaseException):
        try:
            pickle.dumps(error)
        except Exception:  # an exception that cannot travel: its type and text can
            error = RuntimeError(f"{type(error).__name__}: {error}")
        self.error = error


class _MicroBatches(Dataset):
    def __init__(self, loader):
        self.loader = loader

    def __getitem__(self, m: int):
        try:
            return self.loader.micro_batch(m)
        except Exception as e:  # raised by the trainer as it is (not torch's multi-line wrapper)
            return _Failed(e)


class _CountFrom(Sampler):
    def __init__(self, start: int, end: int | None = None):
        self.start, self.end = start, end

    def __iter__(self):
        return itertools.count(self.start) if self.end is None else iter(range(self.start, self.end))


def _exit(code) -> str:
    if code is None:
        return "exit status unknown"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _worker_init(_worker_id: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the trainer's to handle (module docstring)


class MicroBatchFeed:
    """Iterator of ``loader``'s micro-batches from ``loader.consumed`` on, built by
    ``num_workers`` processes (0: on the calling thread when asked, as ``next(loader)``).
    Advances ``loader.consumed`` by one per micro-batch handed out. ``end``: the workers build
    nothing from micro-batch ``end`` on (an evaluation's fixed range; None: the stream never ends)."""

    def __init__(self, loader, num_workers: int, *, timeout: float = WORKER_TIMEOUT_S, end: int | None = None):
        if num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {num_workers}")
        self.loader, self.num_workers, self.timeout, self.end = loader, num_workers, timeout, end
        self._iter, self._next = None, None

    def __iter__(self):
        return self

    def __next__(self):
        m = self.loader.consumed
        if self.end is not None and m >= self.end:
            raise StopIteration
        if self.num_workers == 0:
            batch = self.loader.micro_batch(m)
        else:
            if self._iter is None or self._next != m:  # the first batch, or a resume moved the position
                self._start(m)
            batch = self._receive()
            self._next = m + 1
            if isinstance(batch, _Failed):
                self.close()
                raise batch.error
        self.loader.consumed = m + 1
        return batch

    def _start(self, m: int) -> None:
        self.close()
        data = DataLoader(_MicroBatches(self.loader), batch_size=None, sampler=_CountFrom(m, self.end),
                          num_workers=self.num_workers, pin_memory=torch.cuda.is_available(),
                          timeout=min(POLL_S, self.timeout), prefetch_factor=PREFETCH_FACTOR,
                          worker_init_fn=_worker_init, multiprocessing_context="fork",
                          generator=torch.Generator().manual_seed(0))
        self._iter = iter(data)
        # torch's SIGCHLD handler would raise a dead worker's error in whatever the training
        # thread is doing (a checkpoint write, a collective): taken off its list, the workers'
        # deaths are found here, in _receive, at the next micro-batch (module docstring)
        if getattr(self._iter, "_worker_pids_set", False):
            _signal_handling._remove_worker_pids(id(self._iter))
            self._iter._worker_pids_set = False

    def _receive(self):
        """The next micro-batch from the workers; a :class:`LoaderWorkerError` when one has died
        (seen before waiting, or while waiting: every ``POLL_S`` seconds) or none arrives within
        the timeout."""
        workers = list(self._iter._workers)
        deadline = time.monotonic() + self.timeout
        while True:
            dead = [(k, w) for k, w in enumerate(workers) if not w.is_alive()]  # waitpid(WNOHANG)
            if dead:
                break
            try:  # torch's own liveness check runs only when a wait with a timeout ends, so the
                # DataLoader waits POLL_S at a time (a timed-out wait leaves its iterator as it was)
                return next(self._iter)
            except RuntimeError as e:
                text = (str(e).strip().splitlines() or [""])[0]
                if text.startswith("DataLoader timed out") and time.monotonic() < deadline:
                    continue
                if text.startswith("DataLoader timed out"):
                    self.close()
                    raise LoaderWorkerError(
                        f"--num-workers {self.num_workers}: no micro-batch came from the data-loader "
                        f"workers in {self.timeout:g} s (waiting for micro-batch {self.loader.consumed}): "
                        "a worker hangs or is far too slow (a stalled filesystem?); resume from the "
                        "last checkpoint, with --num-workers 0 to build micro-batches on the "
                        "training thread") from None
                if not text.startswith("DataLoader worker"):
                    raise
                dead = [(k, w) for k, w in enumerate(workers) if not w.is_alive()]
                break
        self.close()
        raise LoaderWorkerError(self._describe(dead))

    def worker_pids(self) -> list[int]:
        """The workers' process ids, in worker order (empty before the first micro-batch)."""
        return [w.pid for w in getattr(self._iter, "_workers", [])]

    def _describe(self, dead: list) -> str:
        who = ", ".join(f"worker {k} (pid {w.pid}, {_exit(w.exitcode)})" for k, w in dead) or "a worker"
        why = ("shared memory (/dev/shm) full? a container needs --shm-size of a few times a "
               "micro-batch's bytes" if any(w.exitcode == -signal.SIGBUS for _, w in dead)
               else "out of host memory? see dmesg")
        return (f"--num-workers {self.num_workers}: data-loader {who} died while the trainer waited "
                f"for micro-batch {self.loader.consumed}: the run stops ({why}); resume from the "
                "last checkpoint, with fewer workers or --num-workers 0")

    def close(self) -> None:
        """Stop the workers (the micro-batches built ahead are dropped; the position is kept)."""
        it, self._iter, self._next = self._iter, None, None
        if it is not None:
            it._shutdown_workers()

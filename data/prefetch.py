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
  ``--num-workers 0`` gives); a worker that dies (killed, out of memory) is caught by torch's
  SIGCHLD handler or its liveness check, and a worker that hangs by the loader's timeout:
  both become a :class:`LoaderWorkerError` naming the worker (:meth:`MicroBatchFeed.failures`
  turns torch's message into it wherever in the step it arrives).
"""
from __future__ import annotations

import contextlib
import itertools
import pickle
import re
import signal

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

WORKER_TIMEOUT_S = 600  # the longest a micro-batch may take to arrive before the run stops
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
    def __init__(self, start: int):
        self.start = start

    def __iter__(self):
        return itertools.count(self.start)


def _exit(code) -> str:
    if code is None:
        return "exit status unknown"
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _worker_init(_worker_id: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the trainer's to handle (module docstring)


class MicroBatchFeed:
    """Iterator of ``loader``'s micro-batches from ``loader.consumed`` on, built by
    ``num_workers`` processes (0: on the calling thread when asked, as ``next(loader)``).
    Advances ``loader.consumed`` by one per micro-batch handed out."""

    def __init__(self, loader, num_workers: int, *, timeout: float = WORKER_TIMEOUT_S):
        if num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {num_workers}")
        self.loader, self.num_workers, self.timeout = loader, num_workers, timeout
        self._iter, self._next = None, None

    def __iter__(self):
        return self

    def __next__(self):
        m = self.loader.consumed
        if self.num_workers == 0:
            batch = self.loader.micro_batch(m)
        else:
            if self._iter is None or self._next != m:  # the first batch, or a resume moved the position
                self._start(m)
            with self.failures():
                batch = next(self._iter)
            self._next = m + 1
            if isinstance(batch, _Failed):
                self.close()
                raise batch.error
        self.loader.consumed = m + 1
        return batch

    def _start(self, m: int) -> None:
        self.close()
        data = DataLoader(_MicroBatches(self.loader), batch_size=None, sampler=_CountFrom(m),
                          num_workers=self.num_workers, pin_memory=torch.cuda.is_available(),
                          timeout=self.timeout, prefetch_factor=PREFETCH_FACTOR,
                          worker_init_fn=_worker_init, multiprocessing_context="fork",
                          generator=torch.Generator().manual_seed(0))
        self._iter = iter(data)

    def worker_pids(self) -> list[int]:
        """The workers' process ids, in worker order (empty before the first micro-batch)."""
        return [w.pid for w in getattr(self._iter, "_workers", [])]

    @contextlib.contextmanager
    def failures(self):
        """Turns torch's errors for a dead or silent worker, raised here or anywhere in the block
        (torch's SIGCHLD handler raises in whatever the training thread is doing), into a
        one-line :class:`LoaderWorkerError`."""
        try:
            yield
        except RuntimeError as e:
            text = (str(e).strip().splitlines() or [""])[0]
            if not text.startswith(("DataLoader worker", "DataLoader timed out")):
                raise
            workers = list(getattr(self._iter, "_workers", []))
            self.close()
            raise LoaderWorkerError(self._describe(text, workers)) from None

    def _describe(self, text: str, workers: list) -> str:
        n, at = f"--num-workers {self.num_workers}", self.loader.consumed
        if text.startswith("DataLoader timed out"):
            return (f"{n}: no micro-batch came from the data-loader workers in {self.timeout:g} s "
                    f"(waiting for micro-batch {at}): a worker hangs or is far too slow (a stalled "
                    "filesystem?); resume from the last checkpoint, with --num-workers 0 to build "
                    "micro-batches on the training thread")
        found = re.search(r"\(pid(?:\(s\))? ([\d, ]+)\)", text)
        dead = [int(p) for p in re.findall(r"\d+", found.group(1))] if found else []
        by_pid = {w.pid: (k, w.exitcode) for k, w in enumerate(workers)}
        who = ", ".join(f"worker {by_pid[p][0]} (pid {p}, {_exit(by_pid[p][1])})" if p in by_pid
                        else f"pid {p}" for p in dead) or text
        return (f"{n}: data-loader {who} died while the trainer waited for micro-batch {at} or "
                "later: the run stops (out of host memory? see dmesg); "
                "resume from the last checkpoint, with fewer workers or --num-workers 0")

    def close(self) -> None:
        """Stop the workers (the micro-batches built ahead are dropped; the position is kept)."""
        it, self._iter, self._next = self._iter, None, None
        if it is not None:
            it._shutdown_workers()

"""A process pool that notices when a worker dies, for tools/preprocess_data.py.

``multiprocessing.Pool.imap`` waits forever for a task whose worker was killed (by the
out-of-memory killer, or a crash in a native tokenizer): the pool starts a replacement process
but the task is lost and nobody is told. Here each worker holds one task at a time on its own
pipe, and the parent waits on the results and on every worker's process sentinel together. A
sentinel becomes ready the moment its process exits, so a dead worker raises
:class:`WorkerDied`, naming the task it held, as soon as the parent next waits (milliseconds,
not a timeout). Results come back in submission order, with at most ``window`` tasks taken from
the iterator and not yet returned, so memory stays bounded however long the input is.

Workers ignore SIGINT (a Ctrl-C reaches the whole process group; the parent decides) and exit
when their pipe closes, so they never outlive a parent that was killed outright.
"""
from __future__ import annotations

import multiprocessing as mp
import signal
import traceback
from multiprocessing.connection import wait
from typing import Callable, Iterable, Iterator


class WorkerDied(RuntimeError):
    """A worker process exited while the pool was running."""


class WorkerFailed(RuntimeError):
    """A worker raised; the message carries its traceback."""


def _worker_main(conn, fn, initializer, initargs) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if initializer is not None:
            initializer(*initargs)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if task is None:
            return
        try:
            out = ("ok", fn(task))
        except BaseException:
            out = ("error", traceback.format_exc())
        try:
            conn.send(out)
        except (BrokenPipeError, OSError):
            return


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class OrderedPool:
    """``processes`` spawned workers running ``fn``; use as a context manager.

    ``describe(task)`` names a task in error messages (an input file and byte range, say).
    Leaving the block normally asks the workers to exit; leaving it with an exception
    (including ``KeyboardInterrupt``) terminates them at once.
    """

    def __init__(self, processes: int, fn: Callable, initializer: Callable | None = None,
                 initargs: tuple = (), describe: Callable = repr, context: str = "spawn"):
        ctx = mp.get_context(context)
        self.describe = describe
        self._procs, self._conns = [], []
        try:
            for _ in range(processes):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, args=(child, fn, initializer, initargs),
                                daemon=True)
                p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
        except BaseException:
            self.terminate()
            raise

    def imap(self, tasks: Iterable, window: int | None = None) -> Iterator:
        """``fn(task)`` for each task, in order."""
        window = window or 2 * len(self._procs)
        it = iter(tasks)
        done: dict[int, object] = {}        # sequence number -> result, waiting for its turn
        held: dict[int, tuple] = {}         # worker -> (sequence number, task)
        idle = list(range(len(self._procs)))
        sent = returned = 0
        exhausted = False
        while True:
            # feed idle workers before handing results to the caller, so that no worker waits
            # while the caller writes
            while idle and not exhausted and sent - returned < window:
                try:
                    task = next(it)
                except StopIteration:
                    exhausted = True
                    break
                w = idle.pop()
                try:
                    self._conns[w].send(task)
                except OSError:  # BrokenPipeError: it died while idle
                    self._died(w, None)
                held[w] = (sent, task)
                sent += 1
            if returned in done:
                yield done.pop(returned)
                returned += 1
                continue  # feed again before the next result: the window may have opened
            if exhausted and returned == sent:
                return
            self._wait(held, done, idle)

    def _wait(self, held: dict, done: dict, idle: list) -> None:
        conns = {self._conns[w]: w for w in held}
        sentinels = {p.sentinel: w for w, p in enumerate(self._procs)}
        for obj in wait(list(conns) + list(sentinels)):
            w = conns.get(obj, sentinels.get(obj))
            if obj in sentinels and not self._conns[w].poll():
                self._died(w, held.get(w))
            try:
                kind, value = self._conns[w].recv()
            except (EOFError, OSError):
                self._died(w, held.get(w))
            task = held.pop(w, (None, None))
            if kind == "error":
                where = f" on {self.describe(task[1])}" if task[0] is not None else " while starting"
                raise WorkerFailed(f"a preprocessing worker failed{where}:\n{value}")
            done[task[0]] = value
            idle.append(w)
            if obj in sentinels:  # it sent its last result, then exited
                self._died(w, None)

    def _died(self, w: int, held) -> None:
        p = self._procs[w]
        p.join(1.0)
        what = f"while working on {self.describe(held[1])}" if held else "while idle"
        raise WorkerDied(f"worker process {p.pid} died ({_how(p.exitcode)}) {what}")

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(5.0)
        self.terminate()

    def terminate(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self._conns:
            c.close()

    def __enter__(self) -> "OrderedPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.terminate()

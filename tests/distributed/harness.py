"""Run a function on N gloo ranks (processes) and fail loudly with each rank's error.

Every rank writes its stdout and stderr (file descriptors 1 and 2, so C++/gloo output too) to
``rank{r}.log`` in ``tmpdir`` and its outcome ("ok" or the traceback of ``fn``) to ``rank{r}.txt``.
The parent waits at most ``timeout`` seconds in all. A rank still running shortly before the
deadline writes its Python stack (all threads) to its log; at the deadline every live rank is
terminated and the test fails with each rank's log tail. A rank that exits non-zero (``fn``
raised, a segfault, killed) gets the other ranks terminated at once, rather than leaving them
blocked in a collective until the deadline. ``backend`` (default gloo) is the process group's:
the GPU tests pass ``"cpu:gloo,cuda:nccl"`` (NCCL for CUDA tensors, gloo for CPU ones).

Ranks are forked from a fork server (``multiprocessing``'s "forkserver" start method: a clean
interpreter started once per test process, which imports torch and the project's rank code
(``PRELOAD``) once and forks a rank per request): a rank starts in milliseconds instead of the
~2.5 CPU-seconds of imports a spawned interpreter pays, which on two cores was most of what the
multi-rank tests cost. Each rank is still a fresh process that shares no state with the test
(the server never runs rank code, CUDA is not initialised in it); it gets the test process's
working directory and ``sys.path`` (multiprocessing's own preparation) and environment (here)."""
from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LOG_TAIL_CHARS = 3000
# imported once by the fork server (a module that fails to import there is imported by the rank)
PRELOAD = ("torch", "torch.distributed", "tests.distributed.parallel_cases")
GRACE_S = 2.0  # after a rank fails: how long the others get to exit, then SIGTERM -> SIGKILL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_path(outdir: str, rank: int) -> str:
    return os.path.join(outdir, f"rank{rank}.log")


def _result_path(outdir: str, rank: int) -> str:
    return os.path.join(outdir, f"rank{rank}.txt")


def _redirect_output(path: str):
    """Point fds 1 and 2 at ``path`` (line-buffered Python streams on top); returns the file."""
    log = open(path, "a", buffering=1)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=True)
        except Exception:
            pass
    return log


def _entry(rank, world, port, fn, args, outdir, deadline, timeout, backend="gloo", environ=None, init=True):
    if environ is not None:  # the test process's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(environ)
    log = _redirect_output(_log_path(outdir, rank))
    try:  # die with the parent (pytest killed by CI) instead of the SIGINT torch arranges
        mp._prctl_pr_set_pdeathsig(signal.SIGKILL)
    except Exception:
        pass
    faulthandler.enable(file=log)  # segfault / abort: Python stack to the log
    faulthandler.register(signal.SIGTERM, file=log, chain=True)  # stack when the parent kills us
    # Dump the stack a little before the parent's deadline (``deadline`` is wall-clock, so the
    # seconds this process took to start count against it).
    margin = min(10.0, max(2.0, 0.05 * timeout))
    faulthandler.dump_traceback_later(max(0.5, deadline - time.time() - margin), exit=False,
                                      file=log)
    print(f"[harness] rank {rank}/{world} pid {os.getpid()} ({time.process_time():.1f} CPU-s to start)", flush=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not init:  # fn starts the process group itself, from torchrun's variables
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    pg_timeout = datetime.timedelta(seconds=timeout)
    # Subgroups made by dist.new_group() without a timeout take this module default (30 min),
    # not the world group's: lower it in this process so their collectives time out too.
    dist.distributed_c10d.default_pg_timeout = pg_timeout
    try:
        if init and torch.cuda.is_available() and "nccl" in backend:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if init:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=pg_timeout)
        fn(rank, world, *args)
    except BaseException:
        # Report, then exit non-zero without destroying the group (a peer may be blocked in a
        # collective with us) or running finalizers: the parent then terminates the others.
        with open(_result_path(outdir, rank), "w") as f:
            f.write(traceback.format_exc())
        print(f"[harness] rank {rank}: fn raised, traceback in {_result_path(outdir, rank)}",
              flush=True)
        log.flush()
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()
    with open(_result_path(outdir, rank), "w") as f:
        f.write("ok")
    if dist.is_initialized():
        dist.destroy_process_group()


def _terminate(processes) -> None:
    """SIGTERM every live process, SIGKILL whatever is still alive after GRACE_S, reap all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + GRACE_S
    for p in processes:
        p.join(max(0.0, end - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def _tail(path: str, n: int = LOG_TAIL_CHARS) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - n))
        text = f.read().decode("utf-8", errors="replace")
    return ("[...]\n" if size > n else "") + text


def _exit_status(code, killed_by_us: bool) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (" from the harness" if killed_by_us else "")
    return f"exit code {code}"


def run_ranks(world: int, fn, *args, tmpdir: str, timeout: float = 240.0, backend: str = "gloo",
              init: bool = True) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks (``backend``, default gloo); AssertionError
    unless all return. ``init=False``: no process group is started for ``fn``; the ranks get
    torchrun's variables instead (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``; ``OMP_NUM_THREADS=1``), as a script launched by torchrun.

    ``fn`` must be importable (module level): it reaches the ranks pickled. Fails after ``timeout``
    seconds in all, with every rank's log tail (including its stack dumped before the deadline)."""
    os.makedirs(tmpdir, exist_ok=True)
    for r in range(world):
        for path in (_log_path(tmpdir, r), _result_path(tmpdir, r)):
            if os.path.exists(path):
                os.remove(path)
    start = time.monotonic()
    deadline = start + timeout
    mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))  # no effect once it runs
    ctx = mp.start_processes(_entry, args=(world, _free_port(), fn, args, tmpdir,
                                           time.time() + timeout, timeout, backend, dict(os.environ), init),
                             nprocs=world, join=False, start_method="forkserver")
    timed_out = False
    failed_rank = None  # the rank whose non-zero exit stopped the run
    alive_at_stop: set[int] = set()
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            try:
                if ctx.join(timeout=remaining, grace_period=GRACE_S):
                    break
            except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
                # a rank exited non-zero; join() has already terminated the others
                failed_rank = e.error_index
                break
    finally:
        alive_at_stop = {r for r, p in enumerate(ctx.processes) if p.is_alive()}
        _terminate(ctx.processes)
    elapsed = time.monotonic() - start

    codes = [p.exitcode for p in ctx.processes]
    results = []
    for r in range(world):
        path = _result_path(tmpdir, r)
        results.append(open(path).read() if os.path.exists(path) else None)
    if not timed_out and failed_rank is None and all(c == 0 for c in codes) and \
            all(res == "ok" for res in results):
        return

    if timed_out:
        head = (f"run_ranks timed out after {timeout:g} s (waited {elapsed:.1f} s); "
                f"ranks still running at the deadline: {sorted(alive_at_stop)}")
    else:
        bad = [r for r in range(world) if codes[r] != 0 or results[r] != "ok"]
        head = f"run_ranks: rank(s) {bad} failed after {elapsed:.1f} s"
        if failed_rank is not None:
            head += (f"; rank {failed_rank} exited first "
                     f"({_exit_status(codes[failed_rank], False)}), then the others were stopped")
    blocks = [head]
    for r in range(world):
        killed_by_us = r in alive_at_stop or (
            failed_rank is not None and r != failed_rank
            and codes[r] in (-signal.SIGTERM, -signal.SIGKILL))
        status = _exit_status(codes[r], killed_by_us)
        if results[r] == "ok":
            block = f"--- rank {r} --- ok ({status})"
        elif results[r] is not None:
            block = f"--- rank {r} --- ({status})\n{results[r]}"
        else:
            block = f"--- rank {r} --- no result ({status})"
        log = _tail(_log_path(tmpdir, r))
        block += f"\n[log {_log_path(tmpdir, r)}, last {LOG_TAIL_CHARS} chars]\n" + \
            (log if log is not None else "<no log file>")
        blocks.append(block)
    raise AssertionError("\n".join(blocks))


# --- Cases sharing one spawn ------------------------------------------------------------------
# A start of ranks costs a process group's rendezvous and each rank's first imports of what the
# fork server did not preload (with spawned interpreters it was ~2.5 CPU-s of imports per rank).
# Cases that need the same number of ranks therefore run one after another in one start of
# ranks ("spawn" below), each test still passing or failing on its own case.

CASE_DIR = object()  # an argument of a case replaced by that case's own directory


class Prepared:
    """An argument of a case made in the parent before the first spawn that needs it:
    ``make(directory)``, called once per :class:`SharedRanks`, and its value passed instead."""

    def __init__(self, make):
        self.make = make


def _case_done_path(outdir: str, index: int, rank: int) -> str:
    return os.path.join(outdir, f"case{index}.rank{rank}.done")


def _run_cases(rank, world, cases, outdir):
    """Rank side of :class:`SharedRanks`: each ``(fn, args)`` in turn, a barrier after each (the
    next case starts on a quiet group), then a marker that this rank finished it."""
    for index, (fn, args) in enumerate(cases):
        print(f"[harness] rank {rank}: case {index} {fn.__name__}{tuple(args)!r}", flush=True)
        wall, cpu = time.monotonic(), time.process_time()
        fn(rank, world, *args)
        dist.barrier()
        open(_case_done_path(outdir, index, rank), "w").close()
        print(f"[harness] rank {rank}: case {index} done in {time.monotonic() - wall:.1f} s "
              f"({time.process_time() - cpu:.1f} CPU-s)", flush=True)


def _slug(key) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in "-".join(map(str, key)))


class SharedRanks:
    """Cases ``key -> (world, fn, args)`` run in one spawn of ranks per world size.

    :meth:`check` of a key runs, the first time a case of that world size is asked for, every
    case of that size in one ``run_ranks`` (the sum of their timeouts as its deadline), then says
    for its own key: passed (every rank finished it), failed (with ``run_ranks``' report: each
    rank's traceback and log), or, for a case after the failing one, which never ran, runs it
    alone on fresh ranks, so one failure is reported by its own test only and every other case
    keeps a result of its own."""

    def __init__(self, root: str, cases: dict, timeout: float = 240.0):
        self.root, self.cases, self.timeout = root, dict(cases), timeout
        self.outcome: dict = {}  # key -> None (passed) or the failure's text
        self.prepared: dict = {}  # id(Prepared) -> its value

    def _resolve(self, key, args):
        path = os.path.join(self.root, "cases", _slug(key))
        os.makedirs(path, exist_ok=True)
        out = []
        for a in args:
            if isinstance(a, Prepared):
                if id(a) not in self.prepared:
                    made = os.path.join(self.root, "prepared", str(len(self.prepared)))
                    os.makedirs(made)
                    self.prepared[id(a)] = a.make(made)
                a = self.prepared[id(a)]
            out.append(path if a is CASE_DIR else a)
        return tuple(out)

    def _run_world(self, world: int) -> None:
        keys = [k for k, (w, _, _) in self.cases.items() if w == world and k not in self.outcome]
        outdir = os.path.join(self.root, f"world{world}_{len(self.outcome)}")
        batch = [(self.cases[k][1], self._resolve(k, self.cases[k][2])) for k in keys]
        try:
            run_ranks(world, _run_cases, batch, outdir, tmpdir=outdir, timeout=self.timeout * len(keys))
            error = None
        except AssertionError as e:
            error = f"(cases of {world} ranks run in one spawn: {keys})\n{e}"
        for index, key in enumerate(keys):
            if all(os.path.exists(_case_done_path(outdir, index, r)) for r in range(world)):
                self.outcome[key] = None
            else:  # the one that failed; the rest did not run and stay pending
                self.outcome[key] = error or f"case {key} finished on no rank's record"
                break

    def check(self, key) -> None:
        world, fn, args = self.cases[key]
        if key not in self.outcome:
            self._run_world(world)
        if key not in self.outcome:  # after a failed case: on its own ranks
            path = os.path.join(self.root, "alone", _slug(key))
            run_ranks(world, fn, *self._resolve(key, args), tmpdir=path, timeout=self.timeout)
            self.outcome[key] = None
        if self.outcome[key] is not None:
            raise AssertionError(self.outcome[key])

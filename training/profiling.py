"""``--profile``: a torch profiler trace of some iterations on some ranks, as Megatron's flags
name them (``--profile-step-start N --profile-step-end M --profile-ranks ...``): recording starts
when N iterations are done and stops when M are, so iterations N+1 to M (as the log counts them)
are in it, each inside a ``record_function`` named ``iteration I``. Each profiled rank writes
``<log-dir>/profile/trace_rank<R>.json`` (Chrome trace JSON: Perfetto, ``chrome://tracing``) and,
on CUDA, ``<log-dir>/profile/memory_rank<R>.pickle``: the caching allocator's history over the same
iterations (``torch.cuda.memory._record_memory_history``), which https://pytorch.org/memory_viz
reads. A run resumed past N starts at its first iteration; one that ends before M (or stops) writes
what it recorded; one resumed at M or later records nothing and says so. ``check_profile`` refuses
at start-up what would record nothing: a start at or past ``--train-iters``, a rank outside the
world (``M <= N`` is the flags' own rule, train_args.LoggingArgs; M defaults to N + 2)."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

MEMORY_ENTRIES = 200_000  # allocator events kept for the snapshot (the newest, when more happen)


def check_profile(lg, train_iters: int, world: int) -> None:
    """``ValueError`` naming the flag when ``--profile`` would record nothing: its window starts at
    or after the run's last iteration, or a rank of ``--profile-ranks`` is not in the world."""
    if not lg.profile:
        return
    if lg.profile_step_start >= train_iters:
        raise ValueError(f"--profile-step-start {lg.profile_step_start} records nothing: the run ends when "
                         f"--train-iters {train_iters} iterations are done; start below {train_iters}")
    bad = [r for r in lg.profile_ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"--profile-ranks {' '.join(map(str, bad))}: no such rank in a world of {world} "
                         f"(ranks 0 to {world - 1}): it would record nothing")


class StepProfiler:
    def __init__(self, logging_args, rank: int, log):
        lg = logging_args
        self.on = bool(lg.profile) and rank in lg.profile_ranks
        self.start_at, self.end_at, self.rank, self.log = lg.profile_step_start, lg.profile_end, rank, log
        self.dir = os.path.join(lg.log_dir, "profile") if self.on else None
        self.prof = None
        self.first = self.last = None
        self.done = False
        self.cuda = torch.cuda.is_available()

    @contextmanager
    def step(self, done: int):
        """Around the iteration after ``done`` completed ones."""
        if self.on and not self.done and self.prof is None and self.start_at <= done < self.end_at:
            self._start(done + 1)
        elif self.on and not self.done and self.prof is None and done >= self.end_at:
            self.done = True  # resumed at or past the window's end
            print(f"[rank {self.rank}] --profile: nothing recorded: the run starts at iteration {done + 1}, "
                  f"after --profile-step-end {self.end_at}", file=self.log.stream, flush=True)
        if self.prof is None:
            yield
            return
        with torch.profiler.record_function(f"iteration {done + 1}"):
            yield
        self.last = done + 1
        if done + 1 >= self.end_at:
            self.stop()

    def _start(self, first: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        os.makedirs(self.dir, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
        self.prof = profile(activities=activities, record_shapes=True, with_stack=False)
        self.prof.start()
        self.first = first

    def stop(self) -> None:
        """Stop recording and write the files (nothing when nothing is recording)."""
        if self.prof is None:
            return
        prof, self.prof, self.done = self.prof, None, True
        if self.cuda:
            torch.cuda.synchronize()
        prof.stop()
        t0 = time.perf_counter()
        trace = os.path.join(self.dir, f"trace_rank{self.rank}.json")
        prof.export_chrome_trace(trace)
        what = f"trace {trace} (Chrome trace JSON: ui.perfetto.dev or chrome://tracing)"
        if self.cuda:
            snapshot = os.path.join(self.dir, f"memory_rank{self.rank}.pickle")
            torch.cuda.memory._dump_snapshot(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            what += f"; memory snapshot {snapshot} (pytorch.org/memory_viz)"
        span = f"{self.first}" if self.last in (None, self.first) else f"{self.first}-{self.last}"
        if self.last is None:
            span = f"from {self.first} (stopped before it ended)"
        print(f"[rank {self.rank}] --profile: iterations {span} on rank {self.rank}: {what}; written in "
                          f"{time.perf_counter() - t0:.1f} s", file=self.log.stream, flush=True)

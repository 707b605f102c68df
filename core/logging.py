"""Rank-aware logging: one rank prints Megatron-style lines and writes TensorBoard scalars and
``metrics.jsonl`` (training rows, and validation rows whose keys start with ``valid_``); every
other rank writes only warnings and errors, prefixed with its rank."""
from __future__ import annotations

import json
import math
import os
import sys
import time


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != 0 and abs(v) < 1e-3:
            return f"{v:.3E}"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4f}"
    return str(v)


class RankLogger:
    """``is_logger``: this rank owns the step's loss (last pipeline stage, DP rank 0)."""

    LINE_KEYS = (("loss", "lm loss"), ("mtp_loss", "mtp loss"), ("lr", "learning rate"),
                 ("grad_norm", "grad norm"), ("tokens_per_sec", "tokens/s"),
                 ("tflops_per_gpu", "TFLOP/s/GPU"), ("mfu", "MFU"),
                 ("step_ms", "ms/iter"), ("data_wait_s", "data wait s"), ("skipped_steps", "skipped"),
                 ("packing_fill", "fill"),
                 ("moe_imbalance", "moe max/mean"), ("peak_mem_gib", "peak mem GiB"),
                 ("peak_reserved_gib", "reserved GiB"))

    def __init__(self, rank: int, is_logger: bool, log_dir: str | None = None,
                 tensorboard: bool = True, stream=None):
        self.rank, self.is_logger, self.log_dir = rank, is_logger, log_dir
        self.stream = stream or sys.stdout
        self.jsonl = self.tb = None
        if is_logger and log_dir:
            os.makedirs(log_dir, exist_ok=True)
            self.jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a", buffering=1)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                    self.tb = SummaryWriter(log_dir)
                except ImportError:
                    self.warning("tensorboard is not installed: writing metrics.jsonl only "
                                 "(pip install tensorboard)")

    def start_at(self, iteration: int) -> None:
        """This run logs the iterations after ``iteration`` (a resume's, or 0). Rows of
        ``metrics.jsonl`` past it, left by a run interrupted after its last checkpoint (or an
        earlier run in this --log-dir), are moved to ``metrics.superseded.jsonl``, so the file
        holds each iteration once, and TensorBoard hides their events (``purge_step``)."""
        if not self.jsonl:
            return
        path = self.jsonl.name
        self.jsonl.close()
        keep, gone = [], []
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    it = json.loads(line).get("iteration")
                except (ValueError, AttributeError):  # a line torn by a kill: not this run's
                    it = None
                (keep if isinstance(it, int) and it <= iteration else gone).append(line.rstrip("\n") + "\n")
        if gone:
            with open(os.path.join(self.log_dir, "metrics.superseded.jsonl"), "a", encoding="utf-8") as f:
                f.writelines(gone)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.writelines(keep)
            os.replace(path + ".tmp", path)
            self.info(f"{path}: {len(gone)} row(s) past iteration {iteration}, logged by an earlier "
                      "run that went further, moved to metrics.superseded.jsonl")
            if self.tb:
                from torch.utils.tensorboard import SummaryWriter
                self.tb.close()
                self.tb = SummaryWriter(self.log_dir, purge_step=iteration + 1)
        self.jsonl = open(path, "a", buffering=1, encoding="utf-8")

    def info(self, msg: str) -> None:
        if self.is_logger:
            print(msg, file=self.stream, flush=True)

    def warning(self, msg: str) -> None:
        print(f"[rank {self.rank}] WARNING: {msg}", file=sys.stderr, flush=True)

    def error(self, msg: str) -> None:
        print(f"[rank {self.rank}] ERROR: {msg}", file=sys.stderr, flush=True)

    def log_iteration(self, iteration: int, total: int, metrics: dict) -> None:
        if not self.is_logger:
            return
        parts = [f" iteration {iteration:>6}/{total:<6}"]
        for key, label in self.LINE_KEYS:
            if key in metrics and metrics[key] is not None:
                parts.append(f"{label}: {_fmt(metrics[key])}")
        print(" | ".join(parts), file=self.stream, flush=True)
        self._record(iteration, metrics, lambda k: f"train/{k}")

    def _record(self, iteration: int, metrics: dict, tb_name) -> None:
        """One ``metrics.jsonl`` line (non-finite values as null) and the TensorBoard scalars."""
        record = {"iteration": iteration, "time": time.time(),
                  **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                     for k, v in metrics.items()}}
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
        if self.tb:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(tb_name(k), v, iteration)
            self.tb.flush()

    def log_eval(self, iteration: int, metrics: dict) -> None:
        """One validation line (Megatron's form), a ``metrics.jsonl`` record whose keys all start
        with ``valid_`` (no ``loss`` key: training rows stay easy to select) and ``valid/*``
        TensorBoard scalars."""
        if not self.is_logger:
            return
        line = (f" validation loss at iteration {iteration} | lm loss: {metrics['valid_loss']:.6E} | "
                f"lm loss PPL: {metrics['valid_ppl']:.6E}")
        if metrics.get("valid_mtp_loss") is not None:
            line += f" | mtp loss: {metrics['valid_mtp_loss']:.6E}"
        print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), file=self.stream, flush=True)
        self._record(iteration, metrics, lambda k: f"valid/{k.removeprefix('valid_')}")

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()

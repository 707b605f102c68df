"""The training loop around ``core.train_step.train_step``: data, learning-rate schedule,
checkpoints, SIGTERM, non-finite steps and logging. The step itself lives in core."""
from __future__ import annotations

import os
import resource
import signal
import time

import torch
import torch.distributed as dist

from core.checkpointing import CheckpointError, load_checkpoint, resolve, save_checkpoint
from core.logging import RankLogger
from core.optim.build import build_optimizer
from core.optim.lr_schedule import apply_lr, lr_multiplier
from core.parallel_state import ParallelState, local_device
from core.train_step import StepSettings, train_step
from data.loader import THDLoader, open_source, parse_data_path
from data.tokenizers import build_tokenizer
from models.step37.costs import device_peak_tflops, training_flops
from models.step37.parallelize import parallelize, stage_layers
from train_args import RunLayout


class Trainer:
    def __init__(self, args, layout: RunLayout, ps: ParallelState):
        self.args, self.cfg, self.ps, self.M = args, layout.config, ps, layout.num_microbatches
        d, s, a = args.data, args.schedule, args
        torch.manual_seed(s.seed)
        tok = build_tokenizer(d.tokenizer_type, d.tokenizer_model)
        sources = [(w, open_source(prefix, d.seq_length, d.long_docs, s.seed, train_fraction=d.train_fraction,
                                   cache_dir=d.data_cache_path))
                   for w, prefix in parse_data_path(d.data_path)]
        self.fill = sum(src.plan.fill for _, src in sources) / len(sources)
        self.loader = THDLoader(sources, seq_length=d.seq_length, micro_batch_size=d.micro_batch_size,
                                pad_id=tok.pad_id, dp_rank=ps.dp_rank, dp_size=ps.sizes.dp, seed=s.seed)
        self.chunks = parallelize(self.cfg, ps, args)
        self.optimizer, self.groups_summary = build_optimizer(self.chunks, a.optim)
        self.settings = StepSettings(
            hidden_size=self.cfg.hidden_size, device=local_device(),
            dtype=torch.bfloat16 if a.memory.bf16 else torch.float32,
            mtp_depths=self.cfg.num_mtp_layers, mtp_loss_scale=a.model.mtp_loss_scale,
            aux_loss_coeff=a.model.moe_aux_loss_coeff, clip_grad=a.optim.clip_grad,
            router_bias_rate=a.model.moe_bias_update_rate,
            flops_of=lambda b: training_flops(self.cfg, _doc_lengths(b)))
        self.peak_tflops = a.logging.peak_tflops or device_peak_tflops()
        is_logger = ps.is_last_stage and ps.dp_rank == 0
        self.log = RankLogger(ps.rank, is_logger, a.logging.log_dir, a.logging.tensorboard)
        self.iteration, self.skipped, self.in_a_row = 0, 0, 0
        self.stop_requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, *_):
        self.stop_requested = True

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        ck = self.args.checkpoint
        extra = {"loader": self.loader.state_dict(), "rng": torch.get_rng_state(),
                 "skipped": self.skipped}
        meta = {"model": self.cfg.to_dict(), "layout": vars(self.args.parallel),
                "optimizer": self.args.optim.optimizer,
                "stage_layers": [len(r) for r in stage_layers(self.cfg, self.ps.sizes.pp * self.ps.sizes.vpp,
                                                              self.args.parallel.pipeline_layout,
                                                              self.args.data.seq_length)]}
        path = save_checkpoint(ck.save, self.iteration, self.chunks, self.optimizer, extra, meta,
                               ck.keep_last)
        self.log.info(f"saved checkpoint {path}")

    def maybe_resume(self) -> None:
        ck = self.args.checkpoint
        if not ck.load:
            return
        try:
            path = resolve(ck.load)
        except CheckpointError as e:
            if os.path.exists(os.path.join(ck.load, "latest")):
                raise
            self.log.info(f"no checkpoint in {ck.load} yet: starting from scratch ({e})")
            return
        meta, extra = load_checkpoint(path, self.chunks, self.optimizer)
        self.iteration = meta["iteration"]
        state = extra.get("loader") or {"global_consumed": self.iteration * self.M * self.ps.sizes.dp,
                                        "fingerprint": self.loader.fingerprint()}
        self.loader.load_state_dict(state)
        if "rng" in extra:
            torch.set_rng_state(extra["rng"])
        self.skipped = int(extra.get("skipped", 0))
        self.log.info(f"resumed from {path} at iteration {self.iteration}")

    # ------------------------------------------------------------------ one iteration
    def step(self) -> dict:
        a, s = self.args, self.args.schedule
        mult = lr_multiplier(self.iteration, total=s.train_iters, warmup=s.lr_warmup_iters,
                             style=s.lr_decay_style, min_ratio=a.optim.min_lr / a.optim.lr,
                             wsd_decay=s.lr_wsd_decay_iters)
        apply_lr(self.optimizer, mult)
        t0 = time.perf_counter()
        batches = [next(self.loader) for _ in range(self.M)]
        m = train_step(self.chunks, self.ps, self.optimizer, batches, self.settings)
        self.iteration += 1
        if m.skipped:
            self.skipped += 1
            self.in_a_row += 1
            self.log.warning(f"iteration {self.iteration}: non-finite loss or grad norm "
                             f"({m.loss}, {m.grad_norm}): step skipped")
        else:
            self.in_a_row = 0
        dt = time.perf_counter() - t0
        return {"loss": m.loss, "mtp_loss": sum(m.mtp_losses) / len(m.mtp_losses) if m.mtp_losses else None,
                "lr": a.optim.lr * mult,  # the --lr group (matrices under muon/dion)
                "grad_norm": m.grad_norm, "tokens_per_sec": m.num_tokens / dt, "step_ms": 1000 * dt,
                "tflops_per_gpu": m.flops / self.ps.sizes.world / dt / 1e12,
                "mfu": m.flops / self.ps.sizes.world / dt / 1e12 / self.peak_tflops if self.peak_tflops else None,
                "skipped_steps": self.skipped, "packing_fill": self.fill,
                "moe_imbalance": m.moe_imbalance, "peak_mem_gib": _peak_memory_gib()}

    # ------------------------------------------------------------------ loop
    def train(self) -> int:
        a = self.args
        s, ck, lg = a.schedule, a.checkpoint, a.logging
        last = {}
        while self.iteration < s.train_iters:
            last = self.step()
            if self.iteration % lg.log_interval == 0 or self.iteration == s.train_iters:
                self.log.log_iteration(self.iteration, s.train_iters, last)
            if self.in_a_row > ck.max_skipped_steps:
                self.log.error(f"{self.in_a_row} non-finite steps in a row (> --max-skipped-steps "
                               f"{ck.max_skipped_steps}): stopping; lower --lr or check the data")
                if ck.save:
                    self.save()
                return 1
            if ck.save and ck.save_interval and self.iteration % ck.save_interval == 0:
                self.save()
            if self._stop_everywhere():
                self.log.info(f"SIGTERM: saving at iteration {self.iteration} and exiting")
                if ck.save:
                    self.save()
                return 0
        if ck.save and (not ck.save_interval or self.iteration % ck.save_interval):
            self.save()
        n_params = sum(p.numel() for c in self.chunks for p in c.parameters())
        self.log.info(f"optimizer state: {self.optimizer.state_bytes() / max(1, n_params):.2f} bytes "
                      f"per parameter on this rank")
        self.log.info(f"pretrain_step37: {self.iteration} iterations ({self.skipped} skipped), final "
                      f"loss {last.get('loss', float('nan')):.4f}; logs in {lg.log_dir or '-'}, "
                      f"checkpoints in {ck.save or '-'}")
        return 0

    def _stop_everywhere(self) -> bool:
        flag = torch.tensor([int(self.stop_requested)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _doc_lengths(batch) -> list[int]:
    cu, _ = batch.packed_seq_params.host_boundaries()
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def _peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

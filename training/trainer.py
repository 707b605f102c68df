"""The training loop around ``core.train_step.train_step``: data, learning-rate schedule,
evaluation, checkpoints, exits (SIGTERM, ``--exit-interval``, ``--exit-duration-in-mins``),
non-finite steps and logging. The step itself lives in core; evaluation in
``training/evaluate.py``; what checkpoints hold and how a run resumes in ``training/checkpoints.py``."""
from __future__ import annotations

import resource
import signal
import time

import torch
import torch.distributed as dist

from core.checkpoint.sharded import CheckpointError, resolve
from core.costs.flops import device_peak_tflops, training_flops
from core.init import local_rows, shard_bytes
from core.logging import RankLogger
from core.model_api import specs_of
from core.optim.build import build_optimizer
from core.optim.in_backward import InBackwardSteps
from core.optim.lr_schedule import apply_lr, lr_multiplier
from core.optim.masters import masters_of
from core.parallel_state import ParallelState, local_device
from core.train_step import StepSettings, train_step
from core.transformer.block import pending_grads
from data.loader import open_source, parse_data_path
from data.prefetch import MicroBatchFeed
from models import registry
from data.tokenizers import build_tokenizer
from models.registry import shapes_of
from training.run_layout import RunLayout, aux_loss_coeff, evaluates
from training.checkpoints import RunCheckpoints, lora_record, run_flags_record, schedule_record
from training.eval_data import make_loader, validation_loader
from training.evaluate import evaluate
from training.parallelize import parallelize, stage_layers
from training.profiling import StepProfiler


DATA_WAIT_WARN = 0.05  # warn when a logged step waited for data more than this share of it


def step_parts(args, cfg, spec, chunks: list, ps: ParallelState):
    """What ``train_step`` takes besides the chunks and the batches, for the trainer and the
    trace (``training/trace/``): ``(optimizer, its groups' summary, StepSettings)``."""
    a = args
    optimizer, summary = build_optimizer(chunks, a.optim)
    if a.memory.optimizer_in_backward:  # Muon's matrices step in the backward (hooks)
        optimizer.in_backward = InBackwardSteps(optimizer.optimizers["muon"], specs_of(chunks), ps,
                                                pending_grads(chunks))
    shapes = shapes_of(cfg)
    settings = StepSettings(
        hidden_size=cfg.hidden_size, device=local_device(),
        dtype=torch.bfloat16 if a.memory.bf16 else torch.float32,
        mtp_depths=cfg.num_mtp_layers, mtp_loss_scale=a.model.mtp_loss_scale,
        aux_loss_coeff=aux_loss_coeff(a, cfg), clip_grad=a.optim.clip_grad,
        model_aux_experts=cfg.num_experts if spec.model_class.aux_scope == "model" else 0,
        router_bias_rate=a.model.moe_bias_update_rate,
        flops_of=lambda b: training_flops(shapes, _doc_lengths(b)) / ps.sizes.cp)
    return optimizer, summary, settings


class Trainer:
    def __init__(self, args, layout: RunLayout, ps: ParallelState, start_time: float | None = None):
        """``start_time``: when the job started (``time.time()``), for ``--exit-duration-in-mins``."""
        self.args, self.cfg, self.ps, self.M = args, layout.config, ps, layout.num_microbatches
        self.spec = layout.spec
        d, s, a = args.data, args.schedule, args
        self.start_time = start_time or time.time()
        torch.manual_seed(s.seed)
        self.tok = build_tokenizer(d.tokenizer_type, d.tokenizer_model)
        pad = d.pad_multiple(ps.sizes.cp)  # context parallelism packs with documents padded to 2 x cp
        sources = [(w, open_source(prefix, d.seq_length, d.long_docs, s.seed, pad_multiple=pad,
                                   train_fraction=d.train_fraction, cache_dir=d.data_cache_path,
                                   image_processor=registry.image_processor_from_settings))
                   for w, prefix in parse_data_path(d.data_path)]
        self.fill = sum(src.plan.fill for _, src in sources) / len(sources)
        self.loader = make_loader(sources, ps, self.cfg.num_mtp_layers, seq_length=d.seq_length,
                                  micro_batch_size=d.micro_batch_size, pad_id=self.tok.pad_id, seed=s.seed,
                                  pad_multiple=pad, pixel_dtype=torch.bfloat16 if a.memory.bf16 else torch.float32)
        # the micro-batches, built ahead by --num-workers processes from the loader's position
        self.feed = MicroBatchFeed(self.loader, d.num_workers)
        self.valid = validation_loader(args, self.tok.pad_id, ps, self.cfg.num_mtp_layers) \
            if evaluates(args) else None
        # a checkpoint to resume fills every weight (a LoRA run's: the adapters; its frozen base is
        # still read from --load-hf or seeded): no initialisation and no --load-hf read
        self.from_checkpoint = will_load(args.checkpoint)
        t0 = time.perf_counter()
        self.chunks = parallelize(self.cfg, ps, args, from_checkpoint=self.from_checkpoint)
        self.build_s = time.perf_counter() - t0
        self.lora = lora_record(args, self.cfg, self.chunks, ps)  # a LoRA base's identity (collective)
        self.optimizer, self.groups_summary, self.settings = step_parts(args, self.cfg, self.spec, self.chunks, ps)
        self.peak_tflops = a.logging.peak_tflops or device_peak_tflops()
        is_logger = ps.is_last_stage and ps.dp_rank == 0 and ps.cp_rank == 0
        self.log = RankLogger(ps.rank, is_logger, a.logging.log_dir, a.logging.tensorboard)
        self.ckpt = RunCheckpoints(args, self.log)
        self.profiler = StepProfiler(a.logging, ps.rank, self.log)
        self.log.info(self._startup_summary())
        describe = getattr(masters_of(self.chunks), "describe", None)
        if describe is not None:  # --cpu-offload masters: the pinned slab, its pinning time, the threads
            self.log.info(describe())
        if torch.cuda.is_available() and not a.memory.bf16:
            self.log.warning("fp32 on the GPU (no --bf16): attention runs sdpa per document (flash takes "
                             "16-bit inputs only) and the experts a per-expert loop that reads its sizes on "
                             "the host once per MoE layer (grouped_mm's kernel takes bf16): add --bf16")
        self.iteration = self.start_iteration = 0
        self.resumed = False
        self.skipped, self.in_a_row, self.skip_reason = 0, 0, ""
        self.evaluated_at = None
        self.stop_requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, *_):
        self.stop_requested = True

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        """Save this iteration unless this run already did (collective)."""
        if not self.args.checkpoint.save or self.ckpt.saved_iteration == self.iteration:
            return
        extra = {"loader": self.loader.state_dict(), "rng": torch.get_rng_state(),
                 "skipped": self.skipped}
        self.ckpt.save(self.iteration, self.chunks, self.optimizer, extra, self._meta())

    def _meta(self) -> dict:
        a, sizes = self.args, self.ps.sizes
        layers = stage_layers(self.cfg, sizes.pp * sizes.vpp, a.parallel.pipeline_layout, a.data.seq_length)
        return {"family": self.spec.family, "model": self.cfg.to_dict(), "layout": vars(a.parallel),
                **run_flags_record(a), "stage_layers": [len(r) for r in layers], "schedule": schedule_record(a),
                "tokenizer": {"type": a.data.tokenizer_type, "model": a.data.tokenizer_model,
                              "pad_id": self.tok.pad_id, "eod_id": self.tok.eod_id},
                **({"lora": self.lora} if self.lora else {})}

    def _startup_summary(self) -> str:
        a, held = self.args, shard_bytes(self.chunks)
        n = sum(local_rows(p)[0].numel() for c in self.chunks for p in c.parameters())
        source = (f"from --load {a.checkpoint.load} (next; --load-hf not read)" if self.from_checkpoint and not self.lora
                  else f"from --load-hf {a.model.load_hf}" if a.model.load_hf
                  else f"seeded (--seed {a.schedule.seed})")
        return (f"model: {n:,} parameters on this rank ({_size(held['device'])} on the device, "
                f"{_size(held['host'])} in host memory), built in {self.build_s:.1f} s, weights {source}; "
                f"peak host memory so far {_size(_peak_host_gib() * 2**30)}")

    def maybe_resume(self) -> None:
        r = self.ckpt.resume(self._meta(), self.chunks, self.optimizer)
        if r is None:
            if self.from_checkpoint:  # the parameters were left for it to fill
                raise CheckpointError(f"--load {self.args.checkpoint.load}: the checkpoint found at "
                                      "start-up is gone; start again")
            return
        self.resumed = True
        self.iteration = self.start_iteration = r.iteration
        ck, train_iters = self.args.checkpoint, self.args.schedule.train_iters
        if r.iteration > train_iters:
            raise CheckpointError(f"--load {r.path} is at iteration {r.iteration}, past --train-iters "
                                  f"{train_iters}: nothing to train. Give a --train-iters above "
                                  f"{r.iteration}, or --finetune to start a new run from its weights")
        if "loader" in r.extra:
            try:
                ignored = self.loader.load_state_dict(r.extra["loader"], ck.ignore_data_fingerprint)
            except ValueError as e:
                raise CheckpointError(f"--load {r.path}: {e}") from None
            for diff in ignored:
                self.log.warning(f"--ignore-data-fingerprint: resuming on other data: {diff}")
        else:  # a weights-only checkpoint (convert_checkpoint.py import): the iteration says where
            self.loader.consumed = self.iteration * self.M
        if r.note:  # empty when fine-tuning (it said so itself)
            self.log.info(r.note)
        if "rng" in r.extra:
            torch.set_rng_state(r.extra["rng"])
        self.skipped = int(r.extra.get("skipped", 0))

    # ------------------------------------------------------------------ one iteration
    def lr_multiplier(self, iteration: int) -> float:
        """The schedule is a function of the iteration and the flags alone: a run stopped and
        resumed, or extended under a fixed --lr-decay-iters, follows the same one."""
        s, o = self.args.schedule, self.args.optim
        return lr_multiplier(iteration, total=s.decay_iters, warmup=s.warmup_iters, style=s.lr_decay_style,
                             min_ratio=o.min_lr / o.lr, wsd_decay=s.lr_wsd_decay_iters)

    def step(self) -> dict:
        a = self.args
        mult = self.lr_multiplier(self.iteration)
        apply_lr(self.optimizer, mult)
        t0 = time.perf_counter()
        batches = [next(self.feed) for _ in range(self.M)]
        wait = time.perf_counter() - t0
        m = train_step(self.chunks, self.ps, self.optimizer, batches, self.settings)
        self.iteration += 1
        if m.skipped:
            self.skipped += 1
            self.in_a_row += 1
            self.skip_reason = _skip_reason(m, self.args.data.seq_length)
            self.log.warning(f"iteration {self.iteration}: {self.skip_reason}: step skipped")
        else:
            self.in_a_row = 0
        dt = time.perf_counter() - t0
        return {"loss": m.loss if m.num_targets else float("nan"),  # no targets: no loss, not 0
                "mtp_loss": sum(m.mtp_losses) / len(m.mtp_losses) if m.mtp_losses else None,
                "lr": a.optim.lr * mult,  # the --lr group (matrices under muon/dion)
                "grad_norm": m.grad_norm, "tokens_per_sec": m.num_tokens / dt, "step_ms": 1000 * dt,
                "data_wait_s": wait,
                "tflops_per_gpu": m.flops / self.ps.sizes.world / dt / 1e12,
                "mfu": m.flops / self.ps.sizes.world / dt / 1e12 / self.peak_tflops if self.peak_tflops else None,
                "skipped_steps": self.skipped, "packing_fill": self.fill,
                "moe_imbalance": m.moe_imbalance, "peak_mem_gib": _peak_memory_gib(),
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None}

    def evaluate(self) -> dict:
        """Validation loss over --eval-iters global batches (collective)."""
        m = evaluate(self.chunks, self.ps, self.valid, self.M, self.args.eval.eval_iters, self.settings,
                     self.args.data.num_workers)  # the validation batches built in workers too
        self.log.log_eval(self.iteration, m)
        self.evaluated_at = self.iteration
        return m

    # ------------------------------------------------------------------ loop
    def train(self) -> int:
        try:
            return self._train()
        finally:
            self.feed.close()
            self.profiler.stop()  # a run that ends or stops before --profile-step-end: what it recorded

    def _train(self) -> int:
        a = self.args
        if self.from_checkpoint and not self.resumed:
            raise RuntimeError("the parameters were left for --load to fill: call maybe_resume() "
                               "before train()")
        s, ck, lg, e = a.schedule, a.checkpoint, a.logging, a.eval
        last = {}
        self.log.start_at(self.iteration)  # metrics.jsonl: each iteration once, after a resume too
        skipped_before = self.skipped
        if self.valid is None and a.eval.eval_iters:
            self.log.info("no validation data (--split has no validation part and no --valid-data-path): "
                          "no evaluation")
        while self.iteration < s.train_iters:
            with self.profiler.step(self.iteration):
                last = self.step()
            if self.iteration % lg.log_interval == 0 or self.iteration == s.train_iters:
                self.log.log_iteration(self.iteration, s.train_iters, last)
                self._warn_data_wait(last)
            if self.in_a_row > ck.max_skipped_steps:
                self.log.error(f"{self.in_a_row} steps in a row skipped (> --max-skipped-steps "
                               f"{ck.max_skipped_steps}), the last for {self.skip_reason}: stopping")
                self.save()
                self.ckpt.wait()
                return 1
            if self.valid is not None and self.iteration % e.eval_interval == 0:
                self.evaluate()
            if ck.save_interval and self.iteration % ck.save_interval == 0:
                self.save()
            reason = self._exit_reason()
            if reason:
                self.log.info(f"{reason}: {'saving and ' if ck.save else ''}exiting at iteration "
                              f"{self.iteration}{'' if ck.save else ' (no --save: nothing saved)'}")
                self.save()
                self.ckpt.wait()
                return 0
        return self._finish(last, self.skipped - skipped_before)

    def _finish(self, last: dict, skipped: int) -> int:
        """The end of a run that reached --train-iters: final evaluation and save, the summary,
        and an exit status that says whether anything was trained (``skipped``: this run's)."""
        s, ck, lg = self.args.schedule, self.args.checkpoint, self.args.logging
        ran = self.iteration - self.start_iteration
        if ran and self.valid is not None and self.evaluated_at != self.iteration:
            self.evaluate()
        if ran:
            self.save()
        self.ckpt.wait()
        n_params = sum(p.numel() for c in self.chunks for p in c.parameters())
        self.log.info(f"optimizer state: {self.optimizer.state_bytes() / max(1, n_params):.2f} bytes "
                      f"per parameter on this rank")
        if not ran:
            self.log.info(f"pretrain_step37: the checkpoint is at iteration {self.iteration} = "
                          f"--train-iters {s.train_iters}: nothing to train (raise --train-iters "
                          "to train on)")
            return 0
        if skipped == ran:
            self.log.error(f"every step of this run was skipped ({ran}, the last for "
                           f"{self.skip_reason}): nothing was trained")
            return 1
        self.log.info(f"pretrain_step37: {self.iteration} iterations ({self.skipped} skipped), final "
                      f"loss {last.get('loss', float('nan')):.4f}; logs in {lg.log_dir or '-'}, "
                      f"checkpoints in {ck.save or '-'}")
        return 0

    def _warn_data_wait(self, last: dict) -> None:
        """A logged step that waited for data more than 5 % of its time (not this run's first
        step: the workers start there)."""
        wait, step_s = last["data_wait_s"], last["step_ms"] / 1000
        if self.iteration > self.start_iteration + 1 and wait > DATA_WAIT_WARN * step_s:
            n = self.args.data.num_workers
            self.log.warning(f"iteration {self.iteration}: the data loader held the step up {wait:.3f} s "
                             f"({100 * wait / step_s:.0f}% of {step_s:.3f} s): " + (
                                 f"its {n} worker(s) (--num-workers {n}) do not keep up: give more"
                                 if n else "--num-workers 0 builds micro-batches on the training "
                                 "thread: give --num-workers 2 or more"))

    def _exit_reason(self) -> str | None:
        """Why every rank stops now, if they do (collective: one all-reduce per iteration, which
        also tells whether every rank has finished writing an --async-save, then published)."""
        s = self.args.schedule
        minutes = (time.time() - self.start_time) / 60
        over = s.exit_duration_in_mins is not None and minutes >= s.exit_duration_in_mins
        flags = torch.tensor([int(self.stop_requested), int(over), int(self.ckpt.busy())])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        sigterm, over, busy = (bool(x) for x in flags.tolist())
        self.ckpt.poll(busy)
        if sigterm:
            return "SIGTERM"
        if over:
            return f"--exit-duration-in-mins {s.exit_duration_in_mins:g} reached ({minutes:.1f} min)"
        if s.exit_interval and self.iteration % s.exit_interval == 0:
            return f"--exit-interval {s.exit_interval}"
        return None


def _skip_reason(m, seq_length: int) -> str:
    """Why a step was skipped, and what to do about it."""
    if m.num_targets == 0:
        why = ("--seq-length 1: a pack of one token has no label" if seq_length < 2 else
               "the packs hold no token with a label (documents of one token, or a loss mask "
               "that marks nothing)")
        return f"no training targets ({why})"
    return (f"a non-finite loss or grad norm ({m.loss}, {m.grad_norm}): lower --lr or check the "
            "weights and data")


def _doc_lengths(batch) -> list[int]:
    """The micro-batch's document lengths (of the whole pack under context parallelism: each CP
    rank counts 1/cp of its FLOPs)."""
    p = batch.packed_seq_params
    cu = p.cp.cu_seqlens if p.cp is not None else p.host_boundaries()[0]
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def _peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return _peak_host_gib()


def _peak_host_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def will_load(ck) -> bool:
    """Whether ``--load`` names a complete checkpoint now, so ``maybe_resume`` will fill every
    parameter (``RunCheckpoints.resume`` resolves it the same way; when that fails it either
    starts from scratch, as here, or raises)."""
    if not ck.load:
        return False
    try:
        resolve(ck.load)
    except CheckpointError:
        return False
    return True

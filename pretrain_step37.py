#!/usr/bin/env python3
"""Train a Step-3.7-style MoE model on packed THD data across PP / EP / DP.

    torchrun --nproc-per-node 4 pretrain_step37.py --model-preset tiny \\
        --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 \\
        --data-path out/corpus_text_document --seq-length 512 --global-batch-size 8 \\
        --optimizer muon --muon-momentum 0 --train-iters 200 --log-dir runs/tb --save runs/ckpt

Order: flags -> validation (no process group yet) -> process groups -> data -> model -> loop.
``python pretrain_step37.py --help`` lists every flag by section.
"""
from __future__ import annotations

import math
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist

from core.checkpointing import CheckpointError, load_checkpoint, resolve, save_checkpoint
from core.distributed.fsdp import apply_fsdp, reshard
from core.distributed.grads import clip_gradients, grad_norm, reduce_step_loss, sync_gradients, tag_parameters
from core.logging import RankLogger
from core.moe.layer import MoELayer
from core.optim.build import build_optimizer
from core.optim.lr_schedule import apply_lr, lr_multiplier
from core.parallel_state import ParallelSizes, ParallelState
from core.pipeline.executor import PipelineExecutor
from core.pipeline.schedules import build_schedule
from data.loader import THDLoader, open_source, parse_data_path
from data.tokenizers import build_tokenizer
from models.step37 import Step37Config
from models.step37.memory_plan import PlanInputs, format_table, plan
from models.step37.parallelize import apply_recompute, build_chunks, stage_layers
from train_args import parse


def model_config(args) -> Step37Config:
    m = args.model
    src = m.hf_config or m.load_hf
    base = Step37Config.from_hf(src).to_hf() if src else Step37Config.preset(m.model_preset).to_hf()
    return Step37Config.from_hf(base, attention_backend=m.attention_backend)


def validate(args, world: int, check_data: bool = True) -> tuple[Step37Config, ParallelSizes, int]:
    """Everything that can be checked before process groups and data exist."""
    cfg = model_config(args)
    p, d = args.parallel, args.data
    sizes = ParallelSizes(world, pp=p.pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                          vpp=p.virtual_pipeline_model_parallel_size)
    sizes.validate(cfg.num_layers, cfg.num_experts)
    stage_layers(cfg.num_layers, sizes.pp * sizes.vpp, p.pipeline_layout)
    per_step = d.micro_batch_size * sizes.dp
    if d.global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {d.global_batch_size} must be a multiple of "
                         f"--micro-batch-size x data-parallel size = {per_step}")
    M = d.global_batch_size // per_step
    if sizes.vpp > 1 and M % sizes.pp:
        raise ValueError(f"interleaved pipelining needs micro-batches per rank ({M}) divisible by "
                         f"--pipeline-model-parallel-size {sizes.pp}: raise --global-batch-size")
    for _, prefix in parse_data_path(d.data_path) if check_data else []:
        if not os.path.exists(prefix + ".idx"):
            raise ValueError(f"--data-path {prefix}: no {prefix}.idx (write it with tools/preprocess_data.py)")
    tok = build_tokenizer(d.tokenizer_type, d.tokenizer_model)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer vocabulary {tok.vocab_size} exceeds the model's {cfg.vocab_size}")
    return cfg, sizes, M


def init_distributed() -> tuple[int, int]:
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if not dist.is_initialized():
        # with GPUs: NCCL for device tensors, gloo for the few host-side counters
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if world == 1 and "MASTER_ADDR" not in os.environ:  # plain `python`: no rendezvous, no port
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world)
    return world, rank


class Trainer:
    def __init__(self, args, cfg: Step37Config, ps: ParallelState, M: int):
        self.args, self.cfg, self.ps, self.M = args, cfg, ps, M
        d, s = args.data, args.schedule
        torch.manual_seed(s.seed)
        tok = build_tokenizer(d.tokenizer_type, d.tokenizer_model)
        sources = [(w, open_source(prefix, d.seq_length, d.long_docs, s.seed, train_fraction=d.train_fraction))
                   for w, prefix in parse_data_path(d.data_path)]
        self.fill = sum(src.plan.fill for _, src in sources) / len(sources)
        self.loader = THDLoader(sources, seq_length=d.seq_length, micro_batch_size=d.micro_batch_size,
                                pad_id=tok.pad_id, dp_rank=ps.dp_rank, dp_size=ps.sizes.dp, seed=s.seed)
        self.chunks = build_chunks(cfg, ps, args.parallel.pipeline_layout,
                                   dispatcher=args.model.moe_dispatcher)
        self.dtype = torch.bfloat16 if args.memory.params_dtype == "bf16" else torch.float32
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.gather_once = args.memory.data_parallel_sharding == "fsdp" and args.memory.fsdp_gather_once
        for c in self.chunks:
            c.reset_parameters(s.seed)
            if args.model.load_hf:
                c.load_hf(args.model.load_hf)
            c.to(self.device, self.dtype)
            apply_recompute(c, args.memory.recompute_granularity, args.memory.recompute_num_layers)
            if args.memory.data_parallel_sharding == "fsdp":
                apply_fsdp(c, ps, args.memory.cpu_offload, "cuda" if torch.cuda.is_available() else "cpu",
                           gather_once=args.memory.fsdp_gather_once)
        self.params = tag_parameters(self.chunks, ps)
        named = [(n, p) for c in self.chunks for n, p in c.named_parameters()]
        self.optimizer, self.groups_summary = build_optimizer(named, args.optim)
        self.executor = PipelineExecutor(
            self.chunks, ps, seq_tokens=d.seq_length * d.micro_batch_size, hidden_size=cfg.hidden_size,
            dtype=self.dtype, device=self.device, mtp_loss_scale=args.model.mtp_loss_scale, aux_coeff=args.model.moe_aux_loss_coeff)
        self.actions = build_schedule(ps.sizes.pp, ps.sizes.vpp, M)[ps.pp_rank]
        is_logger = ps.is_last_stage and ps.dp_rank == 0
        self.log = RankLogger(ps.rank, is_logger, args.logging.log_dir, args.logging.tensorboard)
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
                "optimizer": self.args.optim.optimizer}
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
        lr = a.optim.lr * mult  # the --lr group (matrices under muon/dion)
        t0 = time.perf_counter()
        batches = [next(self.loader).to(self.device) for _ in range(self.M)]
        counts = torch.tensor([sum(b.num_target_tokens for b in batches),
                               sum(int(b.packed_seq_params.cu_seqlens[-1]) for b in batches)])
        if self.ps.sizes.dp > 1:
            dist.all_reduce(counts, group=self.ps.group("dp"))
        stats = self.executor.run(self.actions, lambda m: batches[m], int(counts[0]),
                                  self.M * self.ps.sizes.dp)
        sync_gradients(self.params, self.ps)
        norm = grad_norm(self.params, self.ps)
        loss, _, mtp = reduce_step_loss(stats.loss_sum, stats.num_tokens, stats.mtp_loss_sums,
                                        num_extra=self.cfg.num_mtp_layers)
        finite = math.isfinite(loss) and math.isfinite(float(norm))
        if finite:
            if a.optim.clip_grad > 0:
                clip_gradients(self.params, a.optim.clip_grad, norm)
            self.optimizer.step()
            self._update_router_bias()
            if self.gather_once:  # the shards changed: drop the stale gathered copies
                reshard(self.chunks)
            self.in_a_row = 0
        else:
            self.skipped += 1
            self.in_a_row += 1
            self.log.warning(f"iteration {self.iteration + 1}: non-finite loss or grad norm "
                             f"({loss}, {float(norm)}): step skipped")
        self.optimizer.zero_grad(set_to_none=True)
        self.iteration += 1
        dt = time.perf_counter() - t0
        return {"loss": loss, "mtp_loss": sum(mtp) / len(mtp) if mtp else None, "lr": lr,
                "grad_norm": float(norm), "tokens_per_sec": float(counts[1]) / dt, "step_ms": 1000 * dt,
                "skipped_steps": self.skipped, "packing_fill": self.fill,
                "moe_imbalance": self._imbalance(), "peak_mem_gib": _peak_memory_gib()}

    def _moe_layers(self):
        return [m for c in self.chunks for m in c.modules() if isinstance(m, MoELayer)]

    def _update_router_bias(self) -> None:
        rate = self.args.model.moe_bias_update_rate
        if not rate:
            return
        for m in self._moe_layers():  # same counts on every replica: reduce over DP first
            counts = m.last_stats["tokens_per_expert"].clone()
            if self.ps.sizes.dp > 1:
                dist.all_reduce(counts, group=self.ps.group("dp"))
            m.router.update_bias(counts, rate)

    def _imbalance(self):
        loads = [m.last_stats["tokens_per_expert"] for m in self._moe_layers() if m.last_stats]
        if not loads:
            return None
        return float(sum(float(l.max() / l.mean().clamp(min=1e-9)) for l in loads) / len(loads))

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
        n_params = sum(p.numel() for p in self.params)
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


def _peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def dry_run(args, cfg: Step37Config, sizes: ParallelSizes, M: int) -> int:
    """Every rank's share on the meta device, its parameter count and memory plan; no allocation."""
    o, m = args.optim, args.memory
    inp = PlanInputs(pp=sizes.pp, vpp=sizes.vpp, ep=sizes.ep, dp=sizes.dp,
                     sharding=m.data_parallel_sharding, cpu_offload=m.cpu_offload,
                     fsdp_gather_once=m.fsdp_gather_once,
                     recompute=m.recompute_granularity, recompute_num_layers=m.recompute_num_layers,
                     seq_length=args.data.seq_length, micro_batch_size=args.data.micro_batch_size,
                     num_microbatches=M, optimizer=o.optimizer, muon_momentum=o.muon_momentum,
                     dion_rank_fraction=o.dion_rank_fraction, param_bytes=2 if m.params_dtype == "bf16" else 4,
                     pipeline_layout=args.parallel.pipeline_layout)
    ranks = plan(cfg, inp)
    print(f"dry run: world {sizes.world} = pp {sizes.pp} x dp {sizes.dp} (ep {sizes.ep}), "
          f"{M} micro-batches per pipeline; nothing allocated")
    print(format_table(ranks, inp))
    worst = max(ranks, key=lambda r: r.device_total)
    print(f"pretrain_step37: dry run done: {sum(r.parameters for r in ranks if r.ep_rank == 0):,} "
          f"parameters on EP rank 0's pipeline; busiest rank needs {worst.device_total / 1e9:.1f} GB "
          f"on device ({'fits' if all(r.fits for r in ranks) else 'does NOT fit'} 141 GB)")
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    world = args.memory.dry_run or int(os.environ.get("WORLD_SIZE", 1))
    try:
        cfg, sizes, M = validate(args, world, check_data=not args.memory.dry_run)
    except ValueError as e:
        print(f"pretrain_step37.py: error: {e}", file=sys.stderr)
        return 2
    if args.memory.dry_run:
        return dry_run(args, cfg, sizes, M)
    init_distributed()
    ps = ParallelState.build(sizes, cfg.num_layers, cfg.num_experts)
    trainer = Trainer(args, cfg, ps, M)
    trainer.log.info(f"layout: world {world} = pp {sizes.pp} x dp {sizes.dp} (ep {sizes.ep}, "
                     f"expert-dp {sizes.expert_dp}), {sizes.vpp} virtual stage(s), {M} micro-batches "
                     f"per rank per iteration; {trainer.groups_summary}")
    try:
        trainer.maybe_resume()
        rc = trainer.train()
    except CheckpointError as e:
        trainer.log.error(str(e))
        rc = 1
    finally:
        trainer.log.close()
        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())

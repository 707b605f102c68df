#!/usr/bin/env python3
"""Train a model of any registered family (Step-3.7, Qwen3-MoE, or one a ``--model-module``
registers) on packed THD data across PP / EP / DP.

    torchrun --nproc-per-node 4 pretrain_step37.py --model-preset tiny \\
        --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 \\
        --data-path out/corpus_text_document --seq-length 512 --global-batch-size 8 \\
        --optimizer muon --muon-momentum 0 --train-iters 200 --log-dir runs/tb --save runs/ckpt

A composer: flags (train_args.py) -> the family's spec from the registry (models/registry.py) ->
validation (no process group yet) -> process groups -> ``parallelize`` (training/parallelize.py)
inside the Trainer -> the loop of
``core.train_step.train_step``. ``--dry-run N`` plans N ranks instead (training/planner/run.py); with ``--trace`` it also
traces one rank's real step on fake tensors (training/trace/), before any GPU memory is touched.
``python pretrain_step37.py --help`` lists every flag by section.
"""
from __future__ import annotations

import datetime
import os
import sys
import time

START_TIME = time.time()  # --exit-duration-in-mins counts from here (before the imports below)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from core.checkpoint.sharded import CheckpointError  # noqa: E402
from core.parallel_state import ParallelState  # noqa: E402
from data.indexed_dataset import DatasetError  # noqa: E402
from data.prefetch import LoaderWorkerError  # noqa: E402
from train_args import parse, validate, validate_plan  # noqa: E402
from training.planner.run import report  # noqa: E402
from training.run_layout import RunLayout  # noqa: E402
from training.trainer import Trainer  # noqa: E402


def init_distributed(timeout_minutes: float = 10.0) -> tuple[int, int]:
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if not dist.is_initialized():
        # with GPUs: NCCL for device tensors, gloo for the few host-side counters
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        kwargs = {"timeout": datetime.timedelta(minutes=timeout_minutes)}
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            # eager NCCL init bound to this GPU: the world communicator exists before the first
            # batch_isend_irecv, which involves only some ranks (a lazily created communicator
            # would need every rank of the group in that first call)
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        if world == 1 and "MASTER_ADDR" not in os.environ:  # plain `python`: no rendezvous, no port
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
    return world, rank


def host_threads(on_host: bool) -> int:
    """With offload the optimizer step runs on the host: it gets this rank's share of the
    machine's cores (torchrun otherwise sets OMP_NUM_THREADS=1, a single-threaded step). A
    plain ``python`` run (no torchrun) keeps an OMP_NUM_THREADS its user set."""
    chosen = "OMP_NUM_THREADS" in os.environ and "LOCAL_WORLD_SIZE" not in os.environ
    if on_host and not chosen:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    return torch.get_num_threads()


def checked_layout(args) -> tuple[int, RunLayout]:
    """The world and the validated layout: ``--dry-run N`` plans N ranks through the planner's own
    checks (``train_args.validate_plan``, as tools/plan_memory.py does); a run checks its files too."""
    if args.memory.trace and not args.memory.dry_run:
        raise ValueError("--trace traces a planned run: add --dry-run N (or use tools/plan_memory.py --trace)")
    if args.memory.dry_run:
        return args.memory.dry_run, validate_plan(args, args.memory.dry_run)
    world = int(os.environ.get("WORLD_SIZE", 1))
    return world, validate(args, world)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        world, layout = checked_layout(args)
    except ValueError as e:
        print(f"pretrain_step37.py: error: {e}", file=sys.stderr)
        return 2
    if args.memory.dry_run:
        return report(args, layout, prog="pretrain_step37 --dry-run")
    timeout = args.parallel.distributed_timeout_minutes
    init_distributed(timeout)
    threads = host_threads(args.memory.uses_host_threads)
    try:
        ps = ParallelState.build(layout.sizes, layout.config.num_layers, layout.config.num_experts,
                                 timeout=datetime.timedelta(minutes=timeout))
        trainer = Trainer(args, layout, ps, start_time=START_TIME)
    except DatasetError as e:  # found opening the data (a plan that cuts an image, say)
        print(f"pretrain_step37.py: error: {e}", file=sys.stderr)
        dist.destroy_process_group()
        return 1
    except Exception as e:
        if peer_failure(e):
            _abort(e, timeout)
        raise
    s = layout.sizes
    cp = f" x cp {s.cp}" if s.cp > 1 else ""
    trainer.log.info(f"layout: world {world} = pp {s.pp} x dp {s.dp}{cp} (ep {s.ep}, expert-dp {s.expert_dp}), "
                     f"{s.vpp} virtual stage(s), {layout.num_microbatches} micro-batches per rank per "
                     f"iteration; {trainer.groups_summary}; {threads} host thread(s) per rank")
    try:
        trainer.maybe_resume()
        rc = trainer.train()
    except (CheckpointError, DatasetError, LoaderWorkerError) as e:  # read mid-run: damage, a dead worker
        trainer.log.error(str(e))
        rc = 1
    except Exception as e:
        trainer.log.close()
        if peer_failure(e):
            _abort(e, timeout)
        raise
    trainer.log.close()
    dist.destroy_process_group()
    return rc


def peer_failure(e: BaseException) -> bool:
    """A collective or transfer that timed out, or whose peer went away."""
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(
        s in text for s in ("timed out", "connection closed by peer", "connection reset by peer"))


def _abort(e: BaseException, timeout_minutes: float) -> None:
    """End this rank at once: no destroy_process_group or finalizers, which could wait on the
    peer that failed (torchrun then stops the others)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    first = (str(e).strip().splitlines() or [""])[0]
    print(f"[rank {rank}] ERROR: a collective or pipeline transfer failed: another rank is frozen, "
          f"dead, or slower than --distributed-timeout-minutes {timeout_minutes:g} "
          f"({type(e).__name__}: {first}). Check the other ranks' logs; raise "
          "--distributed-timeout-minutes only if a rank is legitimately that slow.",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())

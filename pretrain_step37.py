#!/usr/bin/env python3
"""Train a Step-3.7-style MoE model on packed THD data across PP / EP / DP.

    torchrun --nproc-per-node 4 pretrain_step37.py --model-preset tiny \\
        --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 \\
        --data-path out/corpus_text_document --seq-length 512 --global-batch-size 8 \\
        --optimizer muon --muon-momentum 0 --train-iters 200 --log-dir runs/tb --save runs/ckpt

A composer: flags (train_args.py) -> validation (no process group yet) -> process groups ->
``parallelize`` (models/step37/parallelize.py) inside the Trainer -> the loop of
``core.train_step.train_step``. ``--dry-run N`` plans N ranks instead (training/plan.py).
``python pretrain_step37.py --help`` lists every flag by section.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from core.checkpointing import CheckpointError
from core.parallel_state import ParallelState
from train_args import parse, validate
from training.plan import report
from training.trainer import Trainer


def init_distributed() -> tuple[int, int]:
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if not dist.is_initialized():
        # with GPUs: NCCL for device tensors, gloo for the few host-side counters
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        kwargs = {}
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


def main(argv=None) -> int:
    args = parse(argv)
    world = args.memory.dry_run or int(os.environ.get("WORLD_SIZE", 1))
    try:
        layout = validate(args, world, check_files=not args.memory.dry_run)
    except ValueError as e:
        print(f"pretrain_step37.py: error: {e}", file=sys.stderr)
        return 2
    if args.memory.dry_run:
        return report(args, layout, prog="pretrain_step37 --dry-run")
    init_distributed()
    ps = ParallelState.build(layout.sizes, layout.config.num_layers, layout.config.num_experts)
    trainer = Trainer(args, layout, ps)
    s = layout.sizes
    trainer.log.info(f"layout: world {world} = pp {s.pp} x dp {s.dp} (ep {s.ep}, expert-dp {s.expert_dp}), "
                     f"{s.vpp} virtual stage(s), {layout.num_microbatches} micro-batches per rank per "
                     f"iteration; {trainer.groups_summary}")
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

"""Run a function on N gloo ranks (spawned processes) and fail loudly with each rank's error."""
from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        msg = "ok"
    except Exception:
        msg = traceback.format_exc()
    finally:
        with open(os.path.join(outdir, f"rank{rank}.txt"), "w") as f:
            f.write(msg)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, tmpdir: str, timeout: float = 240.0) -> None:
    ctx = mp.start_processes(_entry, args=(world, _free_port(), fn, args, tmpdir), nprocs=world,
                             join=False, start_method="spawn")
    try:
        if not ctx.join(timeout=timeout):
            while not ctx.join(timeout=timeout):
                pass
    except Exception:
        pass
    errors = []
    for r in range(world):
        path = os.path.join(tmpdir, f"rank{r}.txt")
        msg = open(path).read() if os.path.exists(path) else "no result (crashed or timed out)"
        if msg != "ok":
            errors.append(f"--- rank {r} ---\n{msg}")
    assert not errors, "\n".join(errors)

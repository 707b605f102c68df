"""Sharded, atomic, layout-independent training checkpoints (torch.distributed.checkpoint).

Layout on disk::

    SAVE/iter_0000200/          model + optimizer tensors (DCP), extra_rank{r}.pt, meta.json
    SAVE/latest                 "iter_0000200", updated last

Keys are layout-independent: every tensor is stored under its global parameter name, and
parameters that the model declares as stacked experts (``ParamSpec.expert_offset``), with their
optimizer state, one expert per key (``name#e17``). A run with
another pipeline or expert-parallel layout asks for the keys it owns and gets them, so a
checkpoint saved at PP2 x EP2 loads at PP1. Replicated tensors are written once (DCP dedups).

A save goes to ``iter_N.tmp`` and is renamed when every rank has written; ``latest`` moves
only after that. A directory without ``meta.json`` is incomplete and is refused at load; a
good checkpoint is never overwritten in place.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from core.model_api import iter_params, persistent_tensors


class CheckpointError(RuntimeError):
    pass


def _split(name: str, t: torch.Tensor, offset: int | None) -> dict:
    """One key per tensor, or per expert for an expert stack (views, so loading writes in place).

    An FSDP-sharded stack (a DTensor split on dim 0) contributes the experts of its local rows
    only: indexing the DTensor itself would gather a copy."""
    if offset is None:
        return {name: t}
    if isinstance(t, DTensor):
        local = t.to_local()
        first = t.device_mesh.get_local_rank() * math.ceil(t.shape[0] / t.device_mesh.size())
        return {f"{name}#e{offset + first + e}": local[e] for e in range(local.shape[0])}
    return {f"{name}#e{offset + e}": t[e] for e in range(t.shape[0])}


def model_state(chunks) -> dict:
    """Parameters and persistent buffers under their global names (experts split)."""
    out = {}
    for chunk in chunks:
        specs = chunk.param_specs()
        for name, t in persistent_tensors(chunk):
            offset = specs[name].expert_offset if name in specs else None
            out.update(_split(f"model/{name}", t, offset))
    return out


def optimizer_state(chunks, optimizer, *, allocate_from: dict | None = None) -> dict:
    """Optimizer tensors keyed ``optim/<opt>/<param name>/<state key>`` (per expert for stacks).

    ``allocate_from``: checkpoint metadata; states that do not exist yet (optimizers create
    them lazily) are allocated with the saved shapes so DCP can load into them."""
    names = {id(p): (name, spec.expert_offset) for _, name, p, spec in iter_params(chunks)}
    out = {}
    for opt_name, opt in optimizer.optimizers.items():
        for group in opt.param_groups:
            for p in group["params"]:
                name, offset = names[id(p)]
                state = opt.state[p]
                prefix = f"optim/{opt_name}/{name}/"
                if allocate_from is not None and not state:
                    _allocate(state, p, prefix, allocate_from, offset is not None)
                for key, t in state.items():
                    if torch.is_tensor(t):
                        per_expert = offset is not None and t.dim() > 0 and t.shape[:1] == p.shape[:1]
                        out.update(_split(prefix + key, t, offset if per_expert else None))
    return out


def _allocate(state: dict, p: torch.Tensor, prefix: str, meta: dict, expert: bool) -> None:
    keys = {k[len(prefix):].split("#")[0] for k in meta if k.startswith(prefix)}
    for key in keys:
        m = meta.get(prefix + key) or meta[next(k for k in meta if k.startswith(prefix + key + "#"))]
        shape = list(m.size)
        if expert and (prefix + key) not in meta:
            shape = [p.shape[0]] + shape
        if shape == list(p.shape):  # shaped like the parameter: shard it the same way (FSDP)
            state[key] = torch.zeros_like(p, dtype=m.properties.dtype)
        else:  # e.g. Dion's Q: a plain tensor beside this rank's part of the parameter
            device = p.to_local().device if isinstance(p, DTensor) else p.device
            state[key] = torch.zeros(shape, dtype=m.properties.dtype, device=device)


def save_checkpoint(save_dir: str, iteration: int, chunks, optimizer, extra: dict, meta: dict,
                    keep_last: int = 0) -> str:
    """Collective. ``extra``: this rank's small state (loader, RNG, ...); ``meta``: run-wide."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = os.path.join(save_dir, f"iter_{iteration:07d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    state = model_state(chunks)
    if optimizer is not None:
        state.update(optimizer_state(chunks, optimizer))
    dcp.save(state, checkpoint_id=tmp)
    torch.save(extra, os.path.join(tmp, f"extra_rank{rank}.pt"))
    _barrier()
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "iteration": iteration}, f, indent=2)
        if os.path.exists(final):  # same iteration saved again: replace only after success
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = os.path.join(save_dir, "latest")
        with open(pointer + ".tmp", "w") as f:
            f.write(os.path.basename(final))
        os.replace(pointer + ".tmp", pointer)
        if keep_last > 0:
            _prune(save_dir, keep_last)
    _barrier()
    return final


def _prune(save_dir: str, keep_last: int) -> None:
    done = sorted(d for d in os.listdir(save_dir) if d.startswith("iter_") and not d.endswith(".tmp"))
    for d in done[:-keep_last]:
        shutil.rmtree(os.path.join(save_dir, d), ignore_errors=True)


def resolve(load_dir: str) -> str:
    """``load_dir`` itself if it is a checkpoint, else the one its ``latest`` names."""
    if os.path.exists(os.path.join(load_dir, "meta.json")):
        return load_dir
    pointer = os.path.join(load_dir, "latest")
    if not os.path.exists(pointer):
        raise CheckpointError(f"--load {load_dir}: no 'latest' pointer and not a checkpoint directory")
    path = os.path.join(load_dir, open(pointer).read().strip())
    if not os.path.exists(os.path.join(path, "meta.json")):
        raise CheckpointError(f"{path}: incomplete checkpoint (no meta.json); the save did not "
                              "finish. Point --load at an earlier iter_* directory.")
    return path


def load_checkpoint(load_dir: str, chunks, optimizer=None) -> tuple[dict, dict]:
    """Fill ``chunks`` (and ``optimizer``, if given) in place; returns (meta, this rank's extra
    or {})."""
    path = resolve(load_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        reader = dcp.FileSystemReader(path)
        saved = reader.read_metadata().state_dict_metadata
        state = model_state(chunks)
        if optimizer is not None:
            state.update(optimizer_state(chunks, optimizer, allocate_from=saved))
        missing = sorted(k for k in state if k not in saved)
        if missing:
            raise CheckpointError(f"{path}: checkpoint lacks {len(missing)} tensors this model needs, "
                                  f"e.g. {missing[:5]} (different model config or optimizer?)")
        dcp.load(state, checkpoint_id=path)
    except CheckpointError:
        raise
    except Exception as e:  # DCP raises many kinds on torn files
        raise CheckpointError(f"{path}: cannot read checkpoint ({type(e).__name__}: {e})") from e
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    extra_path = os.path.join(path, f"extra_rank{rank}.pt")
    extra = torch.load(extra_path, weights_only=True) if os.path.exists(extra_path) else {}
    return meta, extra


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()

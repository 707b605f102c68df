"""Sharded, atomic, layout-independent training checkpoints (torch.distributed.checkpoint).

Layout on disk::

    SAVE/iter_0000200/          model + optimizer tensors (DCP), extra_rank{r}.pt, meta.json
    SAVE/latest                 "iter_0000200", updated last

A LoRA run (``core/finetune/lora.py``) saves its adapters, their optimizer state and the buffers only: the
frozen base is named by its identity in ``meta.json`` (``training/checkpoints.py``).

Keys are layout-independent: every tensor is stored under its global parameter name, and
parameters that the model declares as stacked experts (``ParamSpec.expert_offset``), with their
optimizer state, one expert per key (``name#e17``). A run with
another pipeline or expert-parallel layout asks for the keys it owns and gets them, so a
checkpoint saved at PP2 x EP2 loads at PP1. Replicated tensors are written once (DCP dedups).

A save goes to ``iter_N.tmp``; when every rank has written its part, rank 0 writes
``meta.json`` and publishes it (``core/checkpoint/directory.py``: renames, ``latest``, pruning, all
ordered so a kill at any point leaves ``latest`` on a complete checkpoint). A save that fails
on any rank (disk full, DCP error) fails on every rank with a ``CheckpointError`` and its
``.tmp`` is removed. ``--async-save``: DCP stages the tensors in host memory and writes them in a
background thread; the publication happens when every rank's write has finished
(``finish_save``), at the latest before the next save or the exit.

Loading reads nothing it trusts (``core/checkpoint/reader.py``): a corrupted, truncated or
crafted file is a ``CheckpointError`` naming it, on every rank.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from core.checkpoint.directory import CheckpointError, discard, iter_name, prepare, publish, resolve
from core.checkpoint.reader import SafeReader, read_extra, read_meta, reading
from core.model_api import iter_params, persistent_tensors
from core.optim.masters import masters_of

__all__ = ["CheckpointError", "PendingSave", "begin_save", "compare_model_config", "finish_save",
           "load_checkpoint", "model_state", "optimizer_state", "read_meta", "resolve",
           "save_checkpoint"]

# model config fields that may change between a save and a resume: how to compute, not what
RUNTIME_FIELDS = ("attention_backend", "init_std")


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


def model_state(chunks, masters_filled: list | None = None, lora: bool = False) -> dict:
    """Parameters and persistent buffers under their global names (experts split); with ``lora``
    (the checkpoint's ``meta.json`` has a ``lora`` entry: a LoRA run's, decided for the whole run,
    not from what one pipeline rank happens to hold) its frozen base (``requires_grad`` False) left
    out (frozen parts of another run, ``--freeze-*``, are saved). A parameter
    stored as bf16 plus a remainder (``core/optim/masters.py``) appears as its fp32 master (a
    copy, in host memory when the parameter is on a GPU), so checkpoints hold fp32 masters in
    every storage mode; ``masters_filled`` collects ``(masters, parameter, copy)`` for a load to
    split the loaded values back."""
    out = {}
    for chunk in chunks:
        specs, masters = chunk.param_specs(), masters_of([chunk])
        params = dict(chunk.named_parameters())
        for name, t in persistent_tensors(chunk):
            p = params.get(name)
            if lora and p is not None and not p.requires_grad:
                continue  # a frozen base (LoRA): never changes, recorded by its identity in meta.json
            if p is not None and p in masters:
                t = _master_copy(masters, p)
                if masters_filled is not None:
                    masters_filled.append((masters, p, t))
            offset = specs[name].expert_offset if name in specs else None
            out.update(_split(f"model/{name}", t, offset))
    return out


def _master_copy(masters, p) -> torch.Tensor:
    m = masters.master(p)
    m = m.cpu() if m.device.type == "cuda" else m
    if isinstance(p, DTensor):
        return DTensor.from_local(m, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return m


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


@dataclass
class PendingSave:
    """A save whose tensors may still be being written (``--async-save``)."""

    save_dir: str
    iteration: int
    tmp: str
    meta: dict
    keep_last: int
    future: Any = None                 # DCP's future for an asynchronous write
    error: BaseException | None = None  # this rank's failure so far

    def done(self) -> bool:
        return self.future is None or self.future.done()


def begin_save(save_dir: str, iteration: int, chunks, optimizer, extra: dict, meta: dict,
               keep_last: int = 0, async_group=None) -> PendingSave:
    """Collective. Write this rank's part into ``iter_N.tmp``: synchronously, or with
    ``async_group`` (a gloo group of every rank, used only by the background writes) in DCP's
    background thread after staging the tensors in host memory. ``finish_save`` publishes."""
    rank = _rank()
    tmp = os.path.join(save_dir, iter_name(iteration) + ".tmp")
    error = None
    if rank == 0:
        try:
            prepare(save_dir, iteration)
        except Exception as e:
            error = e
    _agree(error, f"{tmp}: cannot create the checkpoint directory")
    pending = PendingSave(save_dir, iteration, tmp, dict(meta), keep_last)
    try:
        state = model_state(chunks, lora=bool(meta.get("lora")))
        if optimizer is not None:
            state.update(optimizer_state(chunks, optimizer))
        torch.save(extra, os.path.join(tmp, f"extra_rank{rank}.pt"))
        writer = dcp.FileSystemWriter(tmp)
        if async_group is None:
            dcp.save(state, storage_writer=writer)
        else:
            pending.future = dcp.async_save(state, storage_writer=writer, process_group=async_group)
    except (Exception, CheckpointException) as e:
        pending.error = e
    return pending


def finish_save(pending: PendingSave) -> str:
    """Collective. Wait for this rank's writes; if every rank succeeded, rank 0 writes
    ``meta.json`` and publishes the checkpoint (returns its path); otherwise the ``.tmp`` is
    removed and every rank raises ``CheckpointError``."""
    if pending.future is not None and pending.error is None:
        try:
            pending.future.result()
        except (Exception, CheckpointException) as e:
            pending.error = e
    failed = _any(pending.error is not None)
    final = os.path.join(pending.save_dir, iter_name(pending.iteration))
    error = None
    if _rank() == 0:
        try:
            if failed:
                discard(pending.tmp)
            else:
                with open(os.path.join(pending.tmp, "meta.json"), "w") as f:
                    json.dump({**pending.meta, "iteration": pending.iteration}, f, indent=2)
                    f.flush()
                    os.fsync(f.fileno())
                final = publish(pending.save_dir, pending.iteration, pending.keep_last)
        except Exception as e:
            error = e
    if failed:
        cause = f" ({_describe_save(pending.error)})" if pending.error is not None else \
            " on another rank (see its error)"
        raise CheckpointError(f"{pending.tmp}: saving iteration {pending.iteration} failed{cause}; "
                              "the partial checkpoint was removed and 'latest' is unchanged")
    _agree(error, f"{final}: the checkpoint was written but could not be published")
    return final


def save_checkpoint(save_dir: str, iteration: int, chunks, optimizer, extra: dict, meta: dict,
                    keep_last: int = 0) -> str:
    """Collective, synchronous. ``extra``: this rank's small state (loader, RNG, ...); ``meta``:
    run-wide. Returns the published checkpoint's path."""
    return finish_save(begin_save(save_dir, iteration, chunks, optimizer, extra, meta, keep_last))


def load_checkpoint(load_dir: str, chunks, optimizer=None) -> tuple[dict, dict]:
    """Fill ``chunks`` (and ``optimizer``, if given) in place; returns (meta, this rank's extra
    or {}). Collective when a process group exists: a failure on any rank fails all of them."""
    path = resolve(load_dir)
    error, meta, extra = None, {}, {}
    try:
        with reading(path):  # anything unforeseen below still names the checkpoint
            meta = read_meta(path)
            reader = SafeReader(path)
            saved = reader.read_metadata().state_dict_metadata
            masters_filled = []
            state = model_state(chunks, masters_filled, lora=bool(meta.get("lora")))
            if optimizer is not None:
                state.update(optimizer_state(chunks, optimizer, allocate_from=saved))
            missing = sorted(k for k in state if k not in saved)
            if missing:
                raise CheckpointError(f"{path}: checkpoint lacks {len(missing)} tensors this model "
                                      f"needs, e.g. {missing[:5]} (different model config or optimizer?)")
            try:
                dcp.load(state, storage_reader=reader)
            except (Exception, CheckpointException) as e:
                # name the data file this rank was reading, when the failure is this rank's
                mine = not isinstance(e, CheckpointException) or _rank() in (e.failures or {})
                with reading(reader.last_file if mine and reader.last_file else path):
                    raise e
            for masters, p, value in masters_filled:  # fp32 masters -> bf16 values and remainders
                masters.set_master(p, value.to_local() if isinstance(value, DTensor) else value)
            extra = read_extra(path, _rank())
    except CheckpointError as e:
        error = e
    _agree(error, f"{path}: another rank could not read its part of the checkpoint")
    return meta, extra


def compare_model_config(saved: dict, run: dict) -> list[str]:
    """``"field: checkpoint X, this run Y"`` for every model field that differs (fields missing
    on one side, from older checkpoints, and ``RUNTIME_FIELDS`` are not compared)."""
    out = []
    for key in sorted(set(saved) & set(run)):
        if key not in RUNTIME_FIELDS and saved[key] != run[key]:
            out.append(f"{key}: checkpoint {_short(saved[key])}, this run {_short(run[key])}")
    return out


def _short(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe_save(e: BaseException) -> str:
    if isinstance(e, CheckpointException):
        for cause in (e.failures or {}).values():
            inner = cause[0] if isinstance(cause, tuple) else cause
            return f"{type(inner).__name__}: {inner}"
    return f"{type(e).__name__}: {e}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _any(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any (one all-reduce; no-op on one process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _agree(error: BaseException | None, elsewhere: str) -> None:
    """Raise on every rank if any rank has ``error``: its own message there, ``elsewhere`` on the
    others (which would otherwise carry on into a collective the failed rank never joins)."""
    if _any(error is not None):
        if isinstance(error, CheckpointError):
            raise error
        if error is not None:
            raise CheckpointError(f"{elsewhere}: {type(error).__name__}: {error}") from error
        raise CheckpointError(f"{elsewhere} (see that rank's error)")

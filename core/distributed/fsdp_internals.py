"""FSDP2's private API, in one place: every read or write of what ``fully_shard`` does not document
goes through a named function here, so a torch release that moves one breaks one module, and
``tests/unit/test_fsdp_internals.py`` names what moved (with the torch version) before anything
else fails.

What is private, and why it is needed (:data:`PRIVATE` lists it for the test):

- a unit's state (``FSDPModule._get_fsdp_state``) and its parameter groups: one optional
  ``_fsdp_param_group`` in torch 2.11, a list ``_fsdp_param_groups`` since 2.12 (per-parameter
  meshes), which still answers the singular for one group;
- a group's ``post_forward_mesh_info`` (set to None, the group does not reshard after its forward:
  chunked recompute keeps a block's inner units gathered over its chunks), ``reduce_grads`` and
  ``reshard_after_backward`` (what the public setters set: there is no getter), and
  ``post_backward()`` (a unit's post-backward, run by hand for the chunks whose reruns FSDP's hooks
  skip);
- the state's ``_training_state`` against ``TrainingState.PRE_BACKWARD``
  (``torch.distributed.fsdp._fully_shard._fsdp_common``): whether FSDP takes a unit as in its
  backward already;
- a group's ``offload_policy`` and ``fsdp_params`` (each ``sharded_param``): which shards FSDP keeps
  in host memory (CPU offload), read at materialisation;
- the state's ``_states_to_backward_prefetch``: read back what the public
  ``set_modules_to_backward_prefetch`` set (tests).

Everything else (``fully_shard``, ``unshard``/``reshard``, the ``set_*`` methods) is public and
used where it is needed.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

# (where, attribute): what this module relies on. "where" is a class of FSDP2 (its instances are
# checked, since most of these are set in __init__) or a module path (checked by import)
PRIVATE = (
    ("FSDPModule", "_get_fsdp_state"),
    ("FSDPState", "_fsdp_param_groups | _fsdp_param_group"),
    ("FSDPState", "_training_state"),
    ("FSDPState", "_states_to_backward_prefetch"),
    ("FSDPParamGroup", "post_forward_mesh_info"),
    ("FSDPParamGroup", "reduce_grads"),
    ("FSDPParamGroup", "reshard_after_backward"),
    ("FSDPParamGroup", "post_backward"),
    ("FSDPParamGroup", "offload_policy"),
    ("FSDPParamGroup", "fsdp_params"),
    ("FSDPParam", "sharded_param"),
    ("torch.distributed.fsdp._fully_shard._fsdp_common", "TrainingState.PRE_BACKWARD"),
)
_COMMON = "torch.distributed.fsdp._fully_shard._fsdp_common"


def _moved(what: str) -> RuntimeError:
    return RuntimeError(f"torch {torch.__version__}: FSDP2 has no {what} (a private API that "
                        "core/distributed/fsdp_internals.py relies on; see tests/unit/test_fsdp_internals.py)")


def _get(obj, name: str, owner: str):
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _moved(f"{owner}.{name}") from None


def _pre_backward_state():
    try:
        return importlib.import_module(_COMMON).TrainingState.PRE_BACKWARD
    except (ImportError, AttributeError):
        raise _moved(f"{_COMMON}.TrainingState.PRE_BACKWARD") from None


def state(unit: FSDPModule):
    """The unit's FSDP2 state."""
    return _get(unit, "_get_fsdp_state", "FSDPModule")()


def fsdp_param_groups(st) -> list:
    """An FSDP2 state's parameter groups: a list since torch 2.12 (per-parameter meshes), one
    optional group before (torch 2.11), which newer releases still give for one group."""
    groups = getattr(st, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if not hasattr(st, "_fsdp_param_group"):
        raise _moved("FSDPState._fsdp_param_groups (nor _fsdp_param_group)")
    group = st._fsdp_param_group
    return [] if group is None else [group]


def param_groups(unit: FSDPModule) -> list:
    """The unit's parameter groups (none for a unit without parameters of its own)."""
    return fsdp_param_groups(state(unit))


def fsdp_params(unit: FSDPModule) -> list:
    """FSDP2's per-parameter records of the unit (its accumulators and shards live there)."""
    return [fp for g in param_groups(unit) for fp in _get(g, "fsdp_params", "FSDPParamGroup")]


def offloaded_shards(unit: FSDPModule) -> list:
    """The sharded parameters the unit keeps in host memory (CPU offload): FSDP2 records the
    policy only on its parameter groups."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return [_get(fp, "sharded_param", "FSDPParam") for g in param_groups(unit)
            if isinstance(_get(g, "offload_policy", "FSDPParamGroup"), CPUOffloadPolicy)
            for fp in _get(g, "fsdp_params", "FSDPParamGroup")]


def sharded_param(fp):
    """An ``FSDPParam``'s shard (the DTensor the module holds between steps)."""
    return _get(fp, "sharded_param", "FSDPParam")


def unsharded_param(fp):
    """An ``FSDPParam``'s gathered (unsharded) parameter, None before its first gather (FSDP2 sets
    ``_unsharded_param`` lazily, so it is not in :data:`PRIVATE`; the memory trace reads it)."""
    return getattr(fp, "_unsharded_param", None)


def in_backward(unit: FSDPModule) -> bool:
    """FSDP takes the unit as in its backward already (it then skips the unit's forward hooks and
    its pre-backward)."""
    return _get(state(unit), "_training_state", "FSDPState") == _pre_backward_state()


@contextmanager
def gathered_through_forward(units: list):
    """Inside: ``units`` do not reshard after their forward (FSDP's own switch, a group's
    ``post_forward_mesh_info``), so several forwards of one unit gather once. After: each is
    resharded as after its forward (a no-op where it was told to stay gathered), except a unit
    FSDP takes as in its backward already (a recompute's rerun inside the backward): its
    backward needs it gathered, and FSDP reshards it after that."""
    kept = [(g, _get(g, "post_forward_mesh_info", "FSDPParamGroup")) for u in units for g in param_groups(u)]
    try:
        for g, _ in kept:
            g.post_forward_mesh_info = None
        yield
    finally:
        for g, mesh in kept:
            g.post_forward_mesh_info = mesh
        for u in units:
            if not in_backward(u):
                u.reshard()


def gradient_settings(unit: FSDPModule) -> tuple[bool, bool]:
    """``(reduce gradients, reshard after backward)`` as the public setters left them (no getter)."""
    groups = param_groups(unit)
    reduce = all(_get(g, "reduce_grads", "FSDPParamGroup") for g in groups)
    reshard = all(_get(g, "reshard_after_backward", "FSDPParamGroup") for g in groups)
    return reduce, reshard


def post_backward(unit: FSDPModule) -> None:
    """Run the unit's post-backward (accumulate, or reduce-scatter when gradients sync) by hand."""
    for g in param_groups(unit):
        _get(g, "post_backward", "FSDPParamGroup")()


def backward_prefetch(unit: FSDPModule, among: list) -> list:
    """The modules of ``among`` whose all-gather ``unit`` prefetches in its backward, in the order
    ``set_modules_to_backward_prefetch`` was given them (empty: FSDP's default order)."""
    states = _get(state(unit), "_states_to_backward_prefetch", "FSDPState")
    by_state = {id(state(m)): m for m in among}
    return [by_state[id(s)] for s in states if id(s) in by_state]


def missing(unit: nn.Module) -> list[str]:
    """What of :data:`PRIVATE` a wrapped ``unit`` (with parameters of its own) lacks: checked on
    real instances, since FSDP2 sets most of it in ``__init__``."""
    out = []
    if not isinstance(unit, FSDPModule) or not hasattr(unit, "_get_fsdp_state"):
        return ["FSDPModule._get_fsdp_state"]
    st = unit._get_fsdp_state()
    try:
        groups = fsdp_param_groups(st)
    except RuntimeError:
        out.append("FSDPState._fsdp_param_groups | _fsdp_param_group")
        groups = []
    for name in ("_training_state", "_states_to_backward_prefetch"):
        if not hasattr(st, name):
            out.append(f"FSDPState.{name}")
    if not groups:
        out.append("FSDPParamGroup (the unit has none to check)")
    for g in groups[:1]:
        for name in ("post_forward_mesh_info", "reduce_grads", "reshard_after_backward", "post_backward",
                     "offload_policy", "fsdp_params"):
            if not hasattr(g, name):
                out.append(f"FSDPParamGroup.{name}")
        for fp in getattr(g, "fsdp_params", [])[:1]:
            if not hasattr(fp, "sharded_param"):
                out.append("FSDPParam.sharded_param")
    try:
        _pre_backward_state()
    except RuntimeError:
        out.append(f"{_COMMON}.TrainingState.PRE_BACKWARD")
    return out

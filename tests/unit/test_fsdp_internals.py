"""FSDP2's private API (core/distributed/fsdp_internals.py, the only module that reaches it): every
attribute and function it relies on exists on this torch's real FSDP2 objects, each failure naming
the torch version; the accessors do what the chunked recompute and materialisation need of them.
One process, a one-rank gloo group (no spawn)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from core.distributed import fsdp_internals as fi

TORCH = f"torch {torch.__version__}"
COMMON = "torch.distributed.fsdp._fully_shard._fsdp_common"
# every private name the module relies on, written out here (not read from the module): a use
# added there without an entry here fails test_the_module_lists_what_the_test_checks
STATE = ("_training_state", "_states_to_backward_prefetch")
GROUP = ("post_forward_mesh_info", "reduce_grads", "reshard_after_backward", "post_backward", "offload_policy",
         "fsdp_params")
PARAM = ("sharded_param",)


@pytest.fixture(scope="module")
def model():
    """Two units under a root, on a one-rank CPU mesh (the same FSDP2 objects as on N ranks)."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for layer in m:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        yield m
    finally:
        if own:
            dist.destroy_process_group()


def test_the_module_lists_what_the_test_checks():
    listed = {f"{where}.{name}" for where, name in fi.PRIVATE}
    written = {"FSDPModule._get_fsdp_state", "FSDPState._fsdp_param_groups | _fsdp_param_group",
               *(f"FSDPState.{n}" for n in STATE), *(f"FSDPParamGroup.{n}" for n in GROUP),
               *(f"FSDPParam.{n}" for n in PARAM), f"{COMMON}.TrainingState.PRE_BACKWARD"}
    assert listed == written, (listed ^ written)


def test_every_private_name_exists_in_this_torch(model):
    unit = model[0]
    assert hasattr(unit, "_get_fsdp_state"), f"{TORCH}: FSDPModule._get_fsdp_state is gone"
    st = unit._get_fsdp_state()
    assert hasattr(st, "_fsdp_param_groups") or hasattr(st, "_fsdp_param_group"), \
        f"{TORCH}: FSDPState has neither _fsdp_param_groups nor _fsdp_param_group"
    for name in STATE:
        assert hasattr(st, name), f"{TORCH}: FSDPState.{name} is gone"
    groups = fi.fsdp_param_groups(st)
    assert len(groups) == 1, f"{TORCH}: a Linear unit has {len(groups)} parameter groups, expected 1"
    for name in GROUP:
        assert hasattr(groups[0], name), f"{TORCH}: FSDPParamGroup.{name} is gone"
    for name in PARAM:
        assert hasattr(groups[0].fsdp_params[0], name), f"{TORCH}: FSDPParam.{name} is gone"
    import importlib
    common = importlib.import_module(COMMON)
    assert hasattr(getattr(common, "TrainingState", None), "PRE_BACKWARD"), \
        f"{TORCH}: {COMMON}.TrainingState.PRE_BACKWARD is gone"
    assert fi.missing(unit) == [], f"{TORCH}: {fi.missing(unit)}"


def test_a_missing_name_is_an_error_naming_the_torch_version():
    with pytest.raises(RuntimeError, match=re.escape(f"{TORCH}: FSDP2 has no FSDPState._fsdp_param_groups")):
        fi.fsdp_param_groups(SimpleNamespace())
    with pytest.raises(RuntimeError, match=re.escape(f"{TORCH}: FSDP2 has no FSDPModule._get_fsdp_state")):
        fi.state(nn.Linear(2, 2))
    assert fi.missing(nn.Linear(2, 2)) == ["FSDPModule._get_fsdp_state"]


def test_the_accessors_on_real_units(model):
    a, b = model[0], model[1]
    assert [fp.sharded_param for fp in fi.fsdp_params(a)] == list(a.parameters())  # between steps: the shards
    assert fi.offloaded_shards(a) == []                                            # no CPU offload policy
    assert fi.gradient_settings(a) == (True, True)
    a.set_requires_gradient_sync(False, recurse=False)
    a.set_reshard_after_backward(False, recurse=False)
    assert fi.gradient_settings(a) == (False, False)
    a.set_requires_gradient_sync(True, recurse=False)
    a.set_reshard_after_backward(True, recurse=False)

    assert fi.backward_prefetch(b, [a, b]) == []  # FSDP's default order
    b.set_modules_to_backward_prefetch([a])
    assert fi.backward_prefetch(b, [a, b]) == [a]
    b.set_modules_to_backward_prefetch([])

    # inside: a unit's forward leaves it gathered; after: resharded
    with fi.gathered_through_forward([a]):
        a(torch.ones(2, 4))
        gathered = not isinstance(a.weight, DTensor)
    assert gathered and isinstance(a.weight, DTensor)
    a(torch.ones(2, 4))  # outside: resharded by its own forward
    assert isinstance(a.weight, DTensor)

    # FSDP takes a unit as in its backward once its pre-backward hook (on its output) has run,
    # and no longer after the backward
    seen = {}
    h = a(torch.ones(2, 4))
    h.register_hook(lambda g: seen.update(a=fi.in_backward(a)))
    out = b(h)
    out.register_hook(lambda g: seen.update(b=(fi.in_backward(b), fi.in_backward(a))))
    assert not fi.in_backward(a) and not fi.in_backward(b)
    out.sum().backward()
    assert seen == {"b": (True, False), "a": True}
    assert not fi.in_backward(a) and not fi.in_backward(b)

"""--cpu-offload masters' host memory (core/optim/host_masters.py): the fp32 masters are ordinary
tensors, the only pinned memory is one staging slab per rank, of the bytes the planner books
(training/planner/memory.py) plus SLOT_EXTRA a tensor, sliced into one slot per parameter; an
update goes through its parameter's slot (the update in, the new bf16 weight out) and gives the
values a direct update gives; workers x intra-op threads fit the rank's cores."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.optim import host_masters as hm


@pytest.fixture
def pins(monkeypatch):
    """Every pinned allocation host_masters makes: ("slab", bytes) or ("own", shape)."""
    made = []
    slab, own = hm._pinned_bytes, hm._pinned_like
    monkeypatch.setattr(hm, "_pinned_bytes", lambda n: made.append(("slab", n)) or slab(n))
    monkeypatch.setattr(hm, "_pinned_like", lambda t, dtype=None: made.append(("own", tuple(t.shape))) or own(t, dtype))
    return made


def tiny_model_params():
    """The tiny preset's whole model as one rank holds it under --cpu-offload masters: bf16
    parameters (the routers stay fp32), on the CPU."""
    from core.optim.masters import to_bf16_storage
    from models import registry

    cfg = registry.resolve("tiny")[1]
    with torch.device("meta"):
        chunk = registry.spec_of(cfg).build(cfg, layers=list(range(cfg.num_layers)), first=True, last=True)
    to_bf16_storage(chunk)
    chunk.to_empty(device="cpu")
    return list(chunk.parameters())


def planned_staging_bytes() -> int:
    """The planner's pinned host bytes for that rank (world 1, --bf16 --cpu-offload masters)."""
    from train_args import parse, validate
    from training.planner.memory import plan
    from training.planner.run import plan_inputs

    args = parse(["--model-preset", "tiny", "--bf16", "--cpu-offload", "masters", "--data-path", "x",
                  "--seq-length", "128", "--global-batch-size", "1"])
    layout = validate(args, world=1, check_files=False)
    return plan(layout.config, plan_inputs(args, layout))[0].host["gradients"]


def test_one_pinned_slab_per_rank_of_the_planned_staging_bytes(pins):
    params = tiny_model_params()
    bf16 = [p for p in params if p.dtype == torch.bfloat16]
    m = hm.HostMasters(params)
    assert pins == []  # nothing pinned before pin(): adding parameters only books their slots
    seconds = m.pin()
    assert m.pin() == seconds >= 0 and len(pins) == 1  # pinned once
    kind, nbytes = pins[0]
    planned = planned_staging_bytes()
    assert planned == hm.STAGING * sum(p.numel() for p in bf16)  # 2 bytes an element, as the slab's slots
    # the slab: the planned bytes, and SLOT_EXTRA per tensor for the update's scalars (each slot
    # is 16-byte aligned: the tiny model's element counts are all multiples of 8)
    assert kind == "slab" and nbytes == m.slab_bytes == planned + hm.SLOT_EXTRA * len(bf16)
    assert all(m.host[p].dtype == torch.float32 and not m.host[p].is_pinned() for p in bf16)
    # every slot lies in the slab, none overlaps another
    spans = sorted(m.slots.values())
    assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert all(m.staged[p].data_ptr() == m.slab.data_ptr() + m.slots[p][0] for p in bf16)
    assert "one allocation, 94 slots" in m.describe() and len(pins) == 1


def test_an_update_goes_through_the_slot_and_equals_a_direct_one(pins):
    """Muon's form (a bf16 update and a finite flag) and AdamW's (a bf16 gradient and an fp32 clip
    factor, made fp32 on the host): the master and the staged bf16 weight as computed directly;
    no allocation beyond the slab."""
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(24, 40, generator=g).bfloat16())
    v = torch.nn.Parameter(torch.randn(40, generator=g).bfloat16())
    m = hm.HostMasters([w, v])
    start_w = torch.randn(24, 40, generator=g)
    m.set_master(w, start_w)
    m.set_master(v, torch.randn(40, generator=g))
    u = torch.randn(24, 40, generator=g).bfloat16()
    keep = torch.tensor(True)
    grad = torch.randn(40, generator=g).bfloat16()
    factor = torch.tensor(0.37)

    def muon(master, upd, on):
        master.mul_(torch.where(on, 0.99, 1.0))
        master.add_(torch.where(on, upd.float(), 0.0), alpha=-0.01)

    def adamw_like(master, g16, s):
        master.add_(g16.float() * s, alpha=-0.1)

    want_w = _muon_ref(start_w, u)  # the same ops on tensors of their own
    want_v = m.master(v).clone().add_(grad.float() * factor, alpha=-0.1)
    m.update(w, muon, u, keep)
    m.update(v, adamw_like, grad, factor)
    m.finish()
    assert torch.equal(m.master(w), want_w)
    assert torch.equal(m.master(v), want_v)
    assert torch.equal(w.data, m.master(w).bfloat16()) and torch.equal(v.data, m.master(v).bfloat16())
    assert torch.equal(m.staged[w], w.data)  # the slot now holds the new weight
    assert pins == [("slab", m.slab_bytes)]


def _muon_ref(start, u):
    x, on = start.clone(), torch.tensor(True)
    x.mul_(torch.where(on, 0.99, 1.0))
    x.add_(torch.where(on, u.float(), 0.0), alpha=-0.01)
    return x


def test_an_input_wider_than_its_slot_is_pinned_on_its_own_with_a_warning(pins):
    w = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16))
    m = hm.HostMasters([w])
    m.set_master(w, torch.zeros(8, 8))
    wide = torch.full((8, 8), 0.5)  # an fp32 update: 256 bytes for a 144-byte slot
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.update(w, lambda master, x: master.add_(x), wide)
        m.finish()
    assert torch.equal(m.master(w), wide) and torch.equal(w.data, wide.bfloat16())
    assert pins == [("slab", hm.slot_bytes(64)), ("own", (8, 8))]
    assert any("does not fit its parameter's 144-byte staging slot" in str(c.message) for c in caught)


def test_parameters_added_after_pinning_are_refused():
    m = hm.HostMasters([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))])
    m.pin()
    with pytest.raises(RuntimeError, match="the staging slab is already pinned"):
        m.add([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))])


@settings(max_examples=60, deadline=None)
@given(cores=st.integers(1, 512), workers=st.integers(1, 8))
def test_workers_times_threads_fill_the_cores_less_the_launching_one(cores, workers):
    w, t = hm.thread_plan(cores, workers)
    spare = max(1, cores - 1)
    assert 1 <= w <= workers and t >= 1
    assert w * t <= spare  # never more threads than the rank's cores less one (at least one)
    assert w * t > spare - w  # and no worker's share of a core left idle
    assert w == min(workers, spare)


def test_sized_to_the_cores_it_sets_torchs_intra_op_threads():
    before = torch.get_num_threads()
    try:
        m = hm.HostMasters(cores=14)  # e.g. 112 cores / 8 ranks
        assert (m.workers, torch.get_num_threads()) == (4, 3)
        assert "4 update workers x 3 intra-op threads on 14 cores" in m.describe()
    finally:
        torch.set_num_threads(before)

"""Pipeline point-to-point plans under NCCL's rules: every schedule we run is deadlock-free and
pairs each message with itself; the replay finds the deadlock of the first-wave executor in a
trace recorded from a real run; the replay's rules on hand-made traces."""
from __future__ import annotations

import json
import os

import pytest

from core.pipeline.nccl_replay import Collective, NCCLDeadlock, P2PMismatch, replay
from core.pipeline.p2p import P2POp, batches_of, max_live_buffers, plan_all
from core.pipeline.schedules import Action, build_schedule
from core.pipeline.simulate import plan_makespan, simulate

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _grid():
    for pp in (2, 3, 4, 8):
        for vpp in (1, 2, 3):
            for m in range(pp, 4 * pp + 1):
                if vpp == 1 or m % pp == 0:  # interleaving needs a multiple of pp
                    yield pp, vpp, m


def test_every_schedule_is_nccl_safe():
    count = 0
    for pp, vpp, m in _grid():
        programs = plan_all(build_schedule(pp, vpp, m))
        result = replay({r: batches_of(p) for r, p in programs.items()})
        # every activation and gradient crosses exactly once: 2 operations per message
        assert result.operations == 2 * 2 * m * (pp * vpp - 1), (pp, vpp, m)
        for r, program in programs.items():  # the plan keeps each rank's compute order
            assert [a for a in program if isinstance(a, Action)] == build_schedule(pp, vpp, m)[r]
        count += 1
    assert count == 87  # PP 2,3,4,8 x virtual 1,2,3 x every valid M in [PP, 4 PP]


def test_plan_holds_no_more_than_the_schedule_needs():
    """1F1B: a rank holds one [T, hidden] tensor per in-flight micro-batch (its input, or on the
    first stage its output until the send is retired) plus at most two messages in transit,
    whatever the number of micro-batches."""
    for pp, m in ((2, 8), (4, 8), (8, 32), (8, 64)):
        schedule = build_schedule(pp, 1, m)
        peaks = simulate(schedule).peak_in_flight
        for r, program in plan_all(schedule).items():
            assert max_live_buffers(program, r, pp, pp) <= peaks[r] + 2, (pp, m, r)


def test_plan_order_costs_little_time():
    """The executor issues batches without waiting and waits only for what an action needs:
    1F1B loses nothing to the plan's ordering; interleaved schedules at most 7% (unit costs,
    backward = 2 x forward; waiting on every batch, as a blocking executor would, costs ~20%)."""
    for pp, vpp, m in ((2, 1, 8), (4, 1, 16), (8, 1, 32), (2, 2, 8), (4, 2, 16), (8, 2, 16), (8, 3, 32)):
        schedule = build_schedule(pp, vpp, m)
        free = simulate(schedule).makespan
        timed = plan_makespan(plan_all(schedule), pp)
        assert free <= timed <= (1.0 if vpp == 1 else 1.07) * free, (pp, vpp, m, free, timed)


def _load_trace(name):
    raw = json.load(open(os.path.join(DATA, name)))["ranks"]
    return {int(r): [[P2POp(o["op"], o["peer"], tuple(o["label"]), tuple(o["shape"]), o["dtype"]) for o in unit]
                     for unit in units] for r, units in raw.items()}


def test_replay_finds_the_first_wave_executor_deadlock():
    """Recorded from the first-wave executor (one isend / recv per transfer, paired by tags):
    rank 0 sends micro-batch 1's activation while rank 1 sends micro-batch 0's gradient, and
    under NCCL both sends wait for receives that come later. gloo never showed it."""
    trace = _load_trace("first_wave_executor_pp2_m4.json")
    with pytest.raises(NCCLDeadlock) as e:
        replay(trace)
    msg = str(e.value)
    assert "after 2 of 16 operations" in msg
    assert "rank 0 waits in batch 1: send F1@s1 to 1" in msg and "rank 1 waits in batch 1: send B0@s0 to 0" in msg


def _op(op, peer, label, shape=(4, 8)):
    return P2POp(op, peer, label, shape, "float32")


def test_replay_rules():
    a, g = ("F", 0, 1), ("B", 0, 0)
    # both ranks send first, each send alone: blocks until the receive is posted, which never is
    crossed = {0: [[_op("send", 1, a)], [_op("recv", 1, g)]], 1: [[_op("send", 0, g)], [_op("recv", 0, a)]]}
    with pytest.raises(NCCLDeadlock, match="after 0 of 4 operations"):
        replay(crossed)
    # the same messages, each send paired with the opposite receive in one batch: fine
    paired = {0: [[_op("send", 1, a), _op("recv", 1, g)]], 1: [[_op("recv", 0, a), _op("send", 0, g)]]}
    assert replay(paired).operations == 4
    # NCCL pairs by order, not by tag: rank 1 receiving m1 before m0 gets the wrong tensors
    swapped = {0: [[_op("send", 1, ("F", 0, 1)), _op("send", 1, ("F", 1, 1))]],
               1: [[_op("recv", 0, ("F", 1, 1)), _op("recv", 0, ("F", 0, 1))]]}
    with pytest.raises(P2PMismatch, match="carries send F0@s1 to 1 but is received as recv F1@s1 from 0"):
        replay(swapped)
    with pytest.raises(P2PMismatch, match=r"is \(4, 8\) float32, its receive \(4, 9\) float32"):
        replay({0: [[_op("send", 1, a)]], 1: [[_op("recv", 0, a, (4, 9))]]})
    with pytest.raises(P2PMismatch, match="rank 0's send #1 to rank 1 .* has no receive on rank 1"):
        replay({0: [[_op("send", 1, a)]], 1: []})


def test_strict_replay_assumes_no_progress_inside_a_group():
    """Rank 0 sends to 1 and 2 in one group; rank 2 first waits for rank 1, which first waits
    for rank 0. If NCCL progresses the group's two sends independently this completes, but it
    does not promise that: the strict replay calls it a deadlock, the lenient one does not."""
    m = [("F", i, 1) for i in range(3)]
    chain = {0: [[_op("send", 1, m[0]), _op("send", 2, m[1])]],
             1: [[_op("recv", 0, m[0])], [_op("send", 2, m[2])]],
             2: [[_op("recv", 1, m[2])], [_op("recv", 0, m[1])]]}
    assert replay(chain, strict=False).operations == 6
    with pytest.raises(NCCLDeadlock):
        replay(chain)


def test_collectives_on_another_group_replay_with_the_point_to_point_plan():
    """PP2 x EP2 in miniature: stage 0 is ranks 0, 1 (one EP group), stage 1 ranks 2, 3 (the
    other); stage 0 sends an activation (0 -> 2, 1 -> 3). Each EP group's ranks issuing the
    same sequence completes with every communicator on one queue per rank; rank 1 receiving a
    gradient from 3 before its all-to-all, while rank 3's send waits behind its own stage's
    all-to-all, which waits for rank 2's receive from rank 0, which waits behind rank 0's
    all-to-all with rank 1, is a cycle; a group's rank missing its all-to-all is a mismatch."""
    a01, a23 = [Collective((0, 1), "all-to-all")], [Collective((2, 3), "all-to-all")]
    send = lambda peer, m: [_op("send", peer, m)]
    recv = lambda peer, m: [_op("recv", peer, m)]
    f0, f1, g = ("F", 0, 1), ("F", 1, 1), ("B", 0, 0)
    same = {0: [a01, send(2, f0)], 1: [a01, send(3, f1)], 2: [a23, recv(0, f0)], 3: [a23, recv(1, f1)]}
    assert replay(same).operations == 8
    crossed = {0: [a01, send(2, f0)], 1: [recv(3, g), a01], 2: [recv(0, f0), a23], 3: [a23, send(1, g)]}
    with pytest.raises(NCCLDeadlock, match=r"rank 0 waits in batch 0: all-to-all on ranks \[0, 1\]"):
        replay(crossed)
    with pytest.raises(P2PMismatch, match=r"missing on \[1\]"):
        replay({0: [a01], 1: []})

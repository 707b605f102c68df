"""The rank layout with context parallelism (``core/parallel_state.py``): order tp-cp-ep-dp-pp,
EP carved out of DP x CP (as Megatron), dense replicas over DP x CP, and the errors."""
from __future__ import annotations

import itertools

import pytest

from core.parallel_state import ParallelSizes


def test_cp2_ep2_pp2_on_8_ranks():
    s = ParallelSizes(8, pp=2, ep=2, cp=2)
    assert (s.dp, s.expert_dp) == (2, 2)
    g = s.group_ranks()
    # cp fastest: ranks 0 and 1 split one pack; dp next; pp slowest
    assert g["cp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["pp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    # EP takes the dp x cp ranks in order (cp fastest): here the EP group is the CP group
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["expert_dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert s.coords(3) == {"tp": 0, "cp": 1, "dp": 1, "ep": 1, "expert_dp": 1, "pp": 0}


def test_step_fun_layout_cp8_ep8_on_one_node():
    s = ParallelSizes(8, cp=8, ep=8)
    g = s.group_ranks()
    assert s.dp == 1 and s.expert_dp == 1
    assert g["ep"] == g["cp"] == g["dp_cp"] == [list(range(8))]
    assert g["dp"] == [[r] for r in range(8)]


@pytest.mark.parametrize("world,pp,cp,ep", [(16, 2, 2, 4), (16, 1, 4, 2), (8, 2, 4, 1), (12, 1, 3, 2)])
def test_groups_partition_the_world_and_agree_with_coords(world, pp, cp, ep):
    s = ParallelSizes(world, pp=pp, ep=ep, cp=cp)
    s.validate()
    g = s.group_ranks()
    for kind, groups in g.items():
        if kind == "embedding":
            continue
        flat = sorted(itertools.chain(*groups))
        assert flat == list(range(world)), kind  # every rank in exactly one group of each kind
    for ranks in g["cp"]:  # a CP group: same dp, pp; every cp coordinate
        c = [s.coords(r) for r in ranks]
        assert [x["cp"] for x in c] == list(range(cp)) and len({(x["dp"], x["pp"]) for x in c}) == 1
    for ranks in g["dp_cp"]:  # dense replicas: one pipeline stage, every dp and cp coordinate
        c = [s.coords(r) for r in ranks]
        assert len({x["pp"] for x in c}) == 1 and len({(x["dp"], x["cp"]) for x in c}) == cp * s.dp
    for ranks in g["ep"]:
        assert [s.coords(r)["ep"] for r in ranks] == list(range(ep))
    for ranks in g["expert_dp"]:  # replicas of one expert shard: the same ep rank
        assert len({s.coords(r)["ep"] for r in ranks}) == 1 and len(ranks) == s.expert_dp


def test_errors_name_the_flag():
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp\\*cp\\*pp = 4 "
                                         "\\(--pipeline-model-parallel-size 1, --context-parallel-size 4\\)"):
        ParallelSizes(6, cp=4).validate()
    with pytest.raises(ValueError, match="--expert-model-parallel-size 4 must divide the data-parallel x "
                                         "context-parallel size 2 .*carved out of DP x CP"):
        ParallelSizes(2, cp=2, ep=4).validate()
    with pytest.raises(ValueError, match="--context-parallel-size must be >= 1, got 0"):
        ParallelSizes(2, cp=0).validate()
    with pytest.raises(ValueError, match="--tensor-model-parallel-size must be 1"):
        ParallelSizes(2, tp=2).validate()

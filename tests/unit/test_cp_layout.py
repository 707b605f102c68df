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


def test_cp_wires_every_family_built_on_core_attention_and_refuses_a_block_without_it():
    """apply_context_parallel reaches the generic decoder's attention modules (core's GQA
    ``Attention`` and DeepSeek-V3's ``MLAttention``, through the attention protocol of
    core/transformer/attention.py) and routers in the built-in families; a block that attends
    some other way, or an attention kind that declares no CP exchange, is refused by name."""
    from torch import nn

    from core.context_parallel.apply import apply_context_parallel
    from core.context_parallel.exchange import CPComm
    from core.moe.router import TopKRouter
    from core.transformer.attention import Attention, attention_modules
    from core.transformer.mla import MLAttention
    from models.registry import spec_for_preset

    comm = CPComm(object(), [0, 1], 0)  # a stand-in group: nothing is sent here
    for preset, kind in (("tiny", Attention), ("qwen3-moe-tiny", Attention), ("deepseek-v3-tiny", MLAttention)):
        spec = spec_for_preset(preset)
        chunk = spec.build(spec.preset(preset))
        apply_context_parallel(chunk, comm)
        attn = attention_modules(chunk)
        routers = [m for m in chunk.modules() if isinstance(m, TopKRouter)]
        assert attn and all(isinstance(m, kind) and m.context_parallel.comm is comm for m in attn), preset
        assert routers and all(m.stats_group is comm.group for m in routers), preset

    class Custom(nn.Module):
        def blocks(self):
            return [(0, nn.Linear(2, 2))]

    with pytest.raises(ValueError, match="--context-parallel-size 2: block 0 of Custom has no"):
        apply_context_parallel(Custom(), comm)

    class LocalOnly(nn.Module):  # an attention kind of the protocol without a CP exchange
        lora_projections = ()
        supports_context_parallel = False

    class WithLocalOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = LocalOnly()

        def blocks(self):
            return [(0, self)]

    with pytest.raises(ValueError, match="WithLocalOnly's attn is LocalOnly, which has no CP exchange yet"):
        apply_context_parallel(WithLocalOnly(), comm)


@pytest.mark.parametrize("flags,message", [
    (["--compile"], "--compile with --context-parallel-size > 1 is not supported"),
    (["--attention-backend", "flex"], "--attention-backend flex does not support --context-parallel-size > 1"),
    (["--document-pad-multiple", "6"], "--document-pad-multiple 6 must be a multiple of 2 x --context-parallel-size"),
    (["--seq-length", "130"], "--seq-length 130 must be a multiple of the document pad multiple 4"),
    # dense gradients have replicas on the CP ranks even at DP 1: what DP > 1 needs, CP > 1 needs
    (["--optimizer", "muon", "--muon-momentum", "0", "--optimizer-in-backward"],
     "--optimizer-in-backward with dense replicas"),
    (["--bf16", "--cpu-offload", "masters"], "--cpu-offload masters with dense replicas"),
])
def test_cp_flag_errors_name_the_flag(flags, message):
    from train_args import parse, validate

    args = parse(["--data-path", "unused", "--model-preset", "tiny", "--seq-length", "128", "--global-batch-size", "1",
                  "--context-parallel-size", "2", *flags])
    with pytest.raises(ValueError, match=message):
        validate(args, world=2, check_files=False)

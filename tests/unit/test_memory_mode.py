"""One table of memory modes (core/memory_mode.py) that validation, FSDP wrapping, the planner and
the search all read, and optimizers as a registry (core/optim/registry.py) that state their own
costs and refusals."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from core.cli import UNIT_OPEN, option
from core.memory_mode import MemoryMode
from core.optim import registry
from core.optim.build import build_optimizer, classify
from core.parallel_state import ParallelSizes, ParallelState
from models.step37 import Step37Config
from tests.unit.test_model_hf import thd
from tests.unit.test_model_thd import labels_for
from train_args import MemoryArgs, parse, require, validate
from tests.planner_inputs import inputs
from training.planner.memory import plan
from training.parallelize import build_chunks
from training.planner.search import memory_modes
from training.planner.shares import rank_shares

# ------------------------------------------------------------ an optimizer from the test tree

class PlainSGD(torch.optim.Optimizer):
    """SGD with a momentum buffer (none at momentum 0): what an optimizer of matrices needs to
    declare and no more."""

    def __init__(self, params, lr: float, momentum: float):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                if group["momentum"]:
                    update = self.state[p].setdefault("momentum", torch.zeros_like(p))
                    update.mul_(group["momentum"]).add_(p.grad)
                p.add_(update, alpha=-group["lr"])


@dataclasses.dataclass
class SGDFlags:
    """Its own flag (``--test-sgd-momentum``), in the training flags while it is registered."""

    test_sgd_momentum: float = option(0.9, "test SGD's momentum (0: no buffer)")

    def __post_init__(self):
        require(self, test_sgd_momentum=UNIT_OPEN)


SGD = registry.OptimizerSpec(
    "test-sgd", flags=SGDFlags,
    build=lambda groups, cfg, masters: PlainSGD(groups, lr=cfg.lr, momentum=cfg.test_sgd_momentum),
    state_bytes=lambda shape, numel, opts: 4 * numel if opts.test_sgd_momentum else 0,  # the buffer, fp32
    step_flops=lambda shape, opts: 2.0 * torch.Size(shape).numel(),  # declared: 2 FLOPs a weight
    step_bytes=lambda opts: 24 if opts.test_sgd_momentum else 12,
    refuses={"remainders": "it updates the parameters in their own dtype", "fsdp": "not tried"})


@pytest.fixture
def sgd():
    registry.register(SGD)
    yield SGD
    registry.unregister(SGD.name)


def _optim(name, **own):
    return SimpleNamespace(optimizer=name, lr=0.05, adamw_lr=None, weight_decay=0.0, adam_beta1=0.9,
                           adam_beta2=0.95, adam_eps=1e-8, test_sgd_momentum=0.9, **own)


def test_a_registered_optimizer_trains_and_is_planned_by_its_declaration(sgd):
    """Registered from here (no edit outside tests/): the flags take it, it trains the tiny model
    (loss down over 6 steps on fixed documents), the planner books the optimizer state it
    declares (equal to what it allocates) and the time model its declared FLOPs; its refusal is
    validation's usage error."""
    args = parse(["--data-path", "unused", "--optimizer", sgd.name])
    assert args.optim.optimizer == sgd.name
    validate(args, world=1, check_files=False)
    bad = parse(["--data-path", "unused", "--optimizer", sgd.name, "--bf16", "--store-param-remainders"])
    with pytest.raises(ValueError, match="--optimizer test-sgd with --store-param-remainders is not supported: "
                                         "it updates the parameters in their own dtype"):
        validate(bad, world=1, check_files=False)

    cfg = Step37Config.preset("tiny")
    ps = ParallelState(ParallelSizes(1), 0, {})
    chunk = build_chunks(cfg, ps, seq_length=64)[0]
    opt, summary = build_optimizer([chunk], _optim(sgd.name))
    assert isinstance(opt.optimizers[sgd.name], PlainSGD) and "test-sgd matrices" in summary
    docs = [40, 24]
    tokens, pos, psp = thd(docs, seed=3)
    losses = []
    for _ in range(6):
        out = chunk(tokens, pos, psp, labels=labels_for(tokens, docs))
        loss = out.loss_sum / out.num_tokens
        losses.append(loss.item())
        (loss + sum(out.mtp_loss_sums) / out.num_tokens).backward()  # every parameter gets a gradient
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.9 * losses[0], losses

    inp = inputs(optimizer=sgd.name, num_microbatches=1, seq_length=64)
    planned = plan(cfg, inp)[0]
    state = sum(t.numel() * t.element_size() for st in opt.optimizers[sgd.name].state.values() for t in st.values())
    adamw = sum(t.numel() * t.element_size() for st in opt.optimizers["adamw"].state.values() for t in st.values())
    assert planned.device["optimizer"] == state + adamw

    from training.planner.inputs import optim_options
    from training.planner.timing import optimizer_work

    share = rank_shares(cfg, 1, 1, 1, None, 64)[0][0]
    work = optimizer_work(share, 1, 1, optim_options(sgd.name))
    declared = sum(2.0 * s.t.numel() for s in share.tensors if classify(s.spec, s.t, sgd.name) == "matrix")
    assert work["dense"]["flops"] + work["expert"]["flops"] == declared > 0


def test_a_registered_optimizers_own_option_is_a_flag_and_planned_with(sgd, capsys):
    """The test SGD's own option (one dataclass in its registration): ``--test-sgd-momentum`` is
    a training flag (checked by its dataclass), the planner's inputs hold it (``PlanInputs.optim``,
    in the JSON), and the optimizer state it books follows it: momentum 0 allocates no buffer and
    books none; momentum 0.9 books 4 bytes per matrix element more (the allocated buffers)."""
    from tools import plan_memory
    from training.planner.inputs import optim_options
    from training.planner.run import plan_inputs

    flags = ["--data-path", "unused", "--optimizer", sgd.name, "--seq-length", "64", "--global-batch-size", "1"]
    args = parse([*flags, "--test-sgd-momentum", "0"])
    assert args.optim.test_sgd_momentum == 0.0 and parse(flags).optim.test_sgd_momentum == 0.9
    with pytest.raises(SystemExit):
        parse([*flags, "--test-sgd-momentum", "1.5"])
    assert "--test-sgd-momentum must be in [0, 1), got 1.5" in capsys.readouterr().err
    inp = plan_inputs(args, validate(args, world=1, check_files=False))
    assert inp.optim.test_sgd_momentum == 0.0 and inp.optim.optimizer == sgd.name

    cfg = Step37Config.preset("tiny")
    chunk = build_chunks(cfg, ParallelState(ParallelSizes(1), 0, {}), seq_length=64)[0]
    opt, _ = build_optimizer([chunk], args.optim)
    assert opt.optimizers[sgd.name].param_groups[0]["momentum"] == 0.0
    tokens, pos, psp = thd([40, 24], seed=3)
    out = chunk(tokens, pos, psp, labels=labels_for(tokens, [40, 24]))
    ((out.loss_sum + sum(out.mtp_loss_sums)) / out.num_tokens).backward()
    opt.step()
    nbytes = lambda o: sum(t.numel() * t.element_size() for st in o.state.values() for t in st.values())
    assert nbytes(opt.optimizers[sgd.name]) == 0
    momentum = optim_options(sgd.name, **{**inp.optim.as_dict(), "test_sgd_momentum": 0.9})
    still, moving = plan(cfg, inp)[0], plan(cfg, dataclasses.replace(inp, optim=momentum))[0]
    assert still.device["optimizer"] == nbytes(opt.optimizers["adamw"])
    matrices = sum(p.numel() for g in opt.optimizers[sgd.name].param_groups for p in g["params"])
    assert moving.device["optimizer"] - still.device["optimizer"] == 4 * matrices > 0

    assert plan_memory.main(["--world-size", "1", *flags[2:], "--test-sgd-momentum", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["test_sgd_momentum"] == 0.0


# ------------------------------------------------------------- validation and search agree

LAYOUTS = [  # (world, extra flags, micro-batch size, global batch)
    (1, [], 2, 2),
    (2, [], 1, 2),
    (2, [], 2, 8),
]
OPTIMIZERS = [["--optimizer", "muon", "--muon-momentum", "0"], ["--optimizer", "muon", "--clip-grad", "1"],
              ["--optimizer", "muon", "--clip-grad", "0"], ["--optimizer", "adamw"], ["--optimizer", "dion"]]


def _searchable(mode: MemoryMode, mbs: int, M: int) -> bool:
    """Modes of the search's own domain: recompute of every layer, chunks of one pack each
    where a rank runs one micro-batch (``planner.search._recompute_modes``)."""
    if mode.recompute_num_layers:
        return False
    if mode.recompute_chunks == 1:
        return not mode.offload_recompute_inputs
    return mode.recompute_chunks == mbs and M == 1


@pytest.mark.parametrize("world, extra, mbs, gbs", LAYOUTS)
def test_validation_and_the_search_agree_on_every_memory_mode(world, extra, mbs, gbs):
    """Every combination of the memory flags (both precisions) against each optimizer: the
    trainer's validation accepts it exactly when the layout search lists it (or lists the mode
    it runs identically to)."""
    checked = 0
    for optim in OPTIMIZERS:
        base_args = parse(["--data-path", "unused", "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
                           "--seq-length", "64", *optim, *extra])
        M = gbs // (mbs * world)
        from training.planner.run import plan_inputs

        for bf16 in (False, True):
            base = plan_inputs(base_args)
            base = dataclasses.replace(base, mode=dataclasses.replace(base.mode, bf16=bf16))
            listed = memory_modes(base, world, mbs, 1, M)
            for mode in MemoryMode.every(bf16=bf16):
                if not _searchable(mode, mbs, M):
                    continue
                base_args.memory = MemoryArgs(**dataclasses.asdict(mode))
                try:
                    validate(base_args, world, check_files=False)
                    accepted = True
                except ValueError:
                    accepted = False
                searched = mode in listed or (mode.runs_like_another(world) and accepted)
                assert accepted == searched, (optim, mode)
                checked += 1
    assert checked > 500


# ------------------------------------------------------------------- the example

DION_FSDP = "--optimizer dion with --data-parallel-sharding fsdp is not supported"


def test_dion_with_fsdp_is_refused_by_the_trainer_and_the_planner_with_one_sentence(tmp_path, capsys):
    """Before any model is built (no data, no process group): exit 2 and the same sentence."""
    import pretrain_step37
    from tools import plan_memory

    flags = ["--model-preset", "tiny", "--optimizer", "dion", "--data-parallel-sharding", "fsdp"]
    errors = []
    for run in (lambda: pretrain_step37.main(["--data-path", str(tmp_path / "none"), *flags]),
                lambda: plan_memory.main(["--world-size", "2", *flags])):
        assert run() == 2
        err = capsys.readouterr().err
        assert DION_FSDP in err and "Traceback" not in err
        errors.append(err.split(": error: ")[1])
    assert errors[0] == errors[1]


def test_placement_says_where_each_kind_lives():
    """Host masters at EP2 x DP2 (the 8 x H200 recipe's mode): bf16 weights the only device copy,
    fp32 masters and optimizer state on the host, experts sharded over expert-DP; --cpu-offload
    optimizer: FSDP offloads every unit, gathers once and reduces on every backward."""
    sizes = ParallelSizes(4, pp=1, ep=2)
    pl = MemoryMode(bf16=True, data_parallel_sharding="fsdp", cpu_offload="masters",
                    optimizer_in_backward=True).placement(sizes, 1)
    dense, expert = pl.roles["dense"], pl.roles["expert"]
    assert (dense.shard_world, expert.shard_world) == (4, 2)
    assert (dense.master, dense.optimizer_state, dense.gradient) == ("host", "host", "device")
    assert (dense.compute_dtype, dense.gradient_dtype, dense.gathered) == ("bf16", "bf16", "per micro-batch and pass")
    assert not pl.self_meshes and pl.host_masters and not any(pl.offloaded.values())
    opt = MemoryMode(bf16=True, data_parallel_sharding="fsdp", cpu_offload="optimizer").placement(sizes, 4)
    assert opt.sync_every_microbatch and opt.gather_once and all(opt.offloaded.values()) and not opt.pin_offloaded
    assert opt.roles["expert"].master == "host" and opt.roles["dense"].gathered == "once per step"
    plain = MemoryMode().placement(ParallelSizes(1), 8)
    assert not plain.wraps and plain.roles["dense"].gathered == "whole"

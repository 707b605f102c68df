"""Rank-side bodies of the parallel equivalence tests (importable by spawned processes)."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from core.distributed.grads import clip_gradients
from core.parallel_state import ParallelSizes, ParallelState
from core.pipeline.nccl_replay import replay
from core.pipeline.p2p import max_live_buffers, plan_all
from core.pipeline.schedules import build_schedule
from core.pipeline.simulate import simulate
from core.transformer.attention import Attention
from core.train_step import StepSettings, train_step
from data.indexed_dataset import InMemoryDataset
from data.cp_shard import shard_batch
from data.packing import plan_packs
from data.thd import build_thd_batch
from models import registry
from training.parallelize import parallelize
from train_args import parse

SEQ = 48          # tokens per micro-batch (one pack)
MTP_SCALE = 0.3


def micro_batches(dp: int, M: int, vocab: int, seed: int = 0, pad_multiple: int = 1, packs: int = 1):
    """batches[d][m]: each ``packs`` full THD packs of random documents (several per pack; each
    padded to ``pad_multiple``, as context parallelism packs them)."""
    out = []
    for d in range(dp):
        row = []
        for m in range(M):
            rng = np.random.default_rng([seed, d, m])
            lengths = rng.integers(2, 20, 8 * packs)
            docs = [rng.integers(0, vocab, n) for n in lengths]
            plan = plan_packs(-(-lengths // pad_multiple) * pad_multiple, SEQ, seed=0)
            chosen = []
            for k in range(packs):
                segs = np.array(plan.pack(k))
                segs[:, 2] = lengths[segs[:, 0]]  # planned on padded lengths; the segments are real
                chosen.append(segs)
            row.append(build_thd_batch(chosen, InMemoryDataset(docs), SEQ, pad_id=0, pad_multiple=pad_multiple))
        out.append(row)
    return out


TINY = {"step37": "tiny", "qwen3_moe": "qwen3-moe-tiny", "deepseek_v3": "deepseek-v3-tiny",
        "glm4_moe": "glm4-moe-tiny"}


def tiny_config(family: str = "step37", **kw):
    spec = registry.spec(family)
    return spec.config_class.from_hf(spec.preset(TINY[family]).to_hf(), **kw)


def reference(cfg, batches, aux_coeff, router_bias=None, model=None):
    """One process, every micro-batch of every DP rank: the objective the layouts must match.
    Returns the model (``model``, else a new one; gradients accumulated), the loss per target
    token and the routing load of the whole step per MoE layer."""
    if model is None:
        model = registry.spec_of(cfg).build(cfg, seed=0)
        _set_bias(model, router_bias)
    flat = [b for row in batches for b in row]
    n = sum(int(b.num_target_tokens) for b in flat)
    loss_sum, load = 0.0, 0
    for b in flat:
        out = model(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels)
        obj = (out.loss_sum + MTP_SCALE * sum(out.mtp_loss_sums)) / n
        if aux_coeff:
            obj = obj + aux_coeff * out.aux_loss / len(flat)
        obj.backward()
        loss_sum += float(out.loss_sum)
        load = load + out.expert_load
    return model, loss_sum / n, load


def _set_bias(model, router_bias):
    if router_bias is None:
        return
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(router_bias)


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def run_args(pp: int = 1, vpp: int = 1, ep: int = 1, *flags: str):
    """The training flags of a layout, parsed as pretrain_step37.py parses them (seed 0: the
    reference's initial weights)."""
    return parse(["--data-path", "unused", "--seed", "0", "--pipeline-model-parallel-size", str(pp),
                  "--virtual-pipeline-model-parallel-size", str(vpp),
                  "--expert-model-parallel-size", str(ep), *flags])


def settings(cfg, **kw) -> StepSettings:
    model_wide = registry.spec_of(cfg).model_class.aux_scope == "model"
    return StepSettings(hidden_size=cfg.hidden_size, mtp_depths=cfg.num_mtp_layers, mtp_loss_scale=MTP_SCALE,
                        model_aux_experts=cfg.num_experts if model_wide else 0, **kw)


def global_params(chunk, ref: dict):
    """(name, parameter, the reference's matching tensor name and expert rows) of a chunk."""
    specs = chunk.param_specs()
    for name, p in chunk.named_parameters():
        off = specs[name].expert_offset
        rows = slice(off, off + p.shape[0]) if off is not None else slice(None)
        yield name, p, ref[name], rows


def expected_bias(ref_model, loads, rate):
    """Router bias after one aux-loss-free update from the step's whole load, by layer name."""
    names = {id(m): n for n, m in ref_model.named_modules()}
    return {names[id(m)]: m.router.e_score_correction_bias + rate * torch.sign(load.mean() - load)
            for m, load in zip(ref_model.moe_layers(), loads)}


def held_bound(ps, M: int, T: int, H: int, elt: int = 4) -> int:
    """Most activation bytes the executor may hold after an action: the plan's live ``[T, H]``
    buffers when each is released as early as possible (``max_live_buffers``), plus 64 bytes per
    in-flight micro-batch for scalar losses and freed output placeholders."""
    schedule = build_schedule(ps.sizes.pp, ps.sizes.vpp, M)
    program = plan_all(schedule, ps.ranks("pp"))[ps.rank]
    buffers = max_live_buffers(program, ps.pp_rank, ps.sizes.pp, ps.sizes.pp * ps.sizes.vpp)
    return buffers * T * H * elt + 64 * simulate(schedule).peak_in_flight[ps.pp_rank]


def check_pipeline_comm(m, ps, M: int, cfg) -> None:
    """What the executor issued, replayed under NCCL's rules (all ranks' traces, on rank 0), and
    the activation bytes it held."""
    traces = [None] * ps.sizes.world
    dist.all_gather_object(traces, m.p2p_trace)
    if ps.rank == 0:
        replay(dict(enumerate(traces)))
    assert m.held_bytes_after == 0, m.held_bytes_after
    bound = held_bound(ps, M, SEQ, cfg.hidden_size)
    assert m.peak_held_bytes <= bound, f"rank {ps.rank} held {m.peak_held_bytes} bytes > bound {bound}"


def cp_traces(chunks) -> list:
    """The halo exchanges recorded by this rank's CP group (one ``CPComm`` per rank)."""
    comms = {id(m.context_parallel.comm): m.context_parallel.comm for c in chunks for m in c.modules()
             if getattr(m, "context_parallel", None) is not None}
    return [b for comm in comms.values() for b in comm.trace]


def check_layout(rank, world, pp, vpp, ep, dispatcher="alltoall", aux_coeff=0.0, router_bias=None,
                 bias_rate=0.0, M=None, flags=(), family="step37", cp=1, steps=1, config=None):
    """``steps`` ``train_step``s (clipped SGD with momentum, each on new packs) of the layout
    against one process: per step the loss, grad norm, clipped gradients, parameters after the
    update, MoE load statistics and router biases. (Not AdamW: its first update is ~lr * sign(g),
    which turns 1e-7-relative noise in near-zero entries into full-size steps.) ``config``:
    overrides of the family's tiny config (``ConfigClass.from_hf`` keywords). Tolerance 1e-5
    relative per tensor: layouts sum the same fp32 terms in another order (~1e-7 relative), so
    1e-5 leaves 100x margin and still catches a dropped or doubled term."""
    cfg = tiny_config(family, **(config or {}))
    sizes = ParallelSizes(world, pp=pp, ep=ep, vpp=vpp, cp=cp)
    ps = ParallelState.build(sizes, cfg.num_layers, cfg.num_experts)
    M = M or max(2, pp)
    pad = 2 * cp if cp > 1 else 1
    batches = micro_batches(sizes.dp, M, cfg.vocab_size, pad_multiple=pad)
    ref_model, ref_loss, loads = reference(cfg, batches, aux_coeff, router_bias)
    ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref_model.parameters()))
    ref_init = {n: p.detach().clone() for n, p in ref_model.named_parameters()}

    chunks = parallelize(cfg, ps, run_args(pp, vpp, ep, "--moe-dispatcher", dispatcher, *flags))
    for c in chunks:
        _set_bias(c, router_bias)
    for c in chunks:
        for name, p, want, rows in global_params(c, ref_init):
            assert torch.equal(p.detach(), want[rows]), f"init differs: {name}"
    params = [p for c in chunks for p in c.parameters()]
    clip = 0.5 * float(ref_norm)
    opt = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5, momentum=0.9)
    for step in range(steps):
        if step:  # the next step's packs, through the reference model as updated
            batches = micro_batches(sizes.dp, M, cfg.vocab_size, seed=step, pad_multiple=pad)
            ref_model.zero_grad(set_to_none=True)
            _, ref_loss, loads = reference(cfg, batches, aux_coeff, model=ref_model)
            ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref_model.parameters()))
        _check_step(rank, world, ps, cfg, chunks, opt, batches, M, cp, flags, ref_model, ref_opt, ref_loss,
                    ref_norm, loads, clip, aux_coeff, bias_rate, step)
    if "--compile" in flags:  # new packs (other document boundaries) reuse the graphs
        graphs = dict(torch._dynamo.utils.counters["stats"])
        assert graphs.get("unique_graphs", 0) >= 2, graphs  # something was compiled
        train_step(chunks, ps, torch.optim.SGD(params, lr=0.1), micro_batches(sizes.dp, M, cfg.vocab_size, seed=1)[ps.dp_rank],
                   settings(cfg, aux_loss_coeff=aux_coeff))
        assert dict(torch._dynamo.utils.counters["stats"]) == graphs, (graphs, torch._dynamo.utils.counters["stats"])
    dist.barrier()


def _check_step(rank, world, ps, cfg, chunks, opt, batches, M, cp, flags, ref_model, ref_opt, ref_loss, ref_norm,
                loads, clip, aux_coeff, bias_rate, step):
    """One ``train_step`` of the layout against the reference's step (its gradients already
    accumulated), then the reference's update: the router biases too, so a next step starts equal."""
    mine = batches[ps.dp_rank] if cp == 1 else \
        [shard_batch(b, cp, ps.cp_rank, cfg.num_mtp_layers) for b in batches[ps.dp_rank]]
    if cp > 1:
        for c in chunks:
            for mod in c.modules():
                if getattr(mod, "context_parallel", None) is not None:
                    mod.context_parallel.comm.trace = []
    m = train_step(chunks, ps, opt, mine,
                   settings(cfg, aux_loss_coeff=aux_coeff, clip_grad=clip, router_bias_rate=bias_rate))

    check_pipeline_comm(m, ps, M, cfg)
    if cp > 1:  # the halo exchanges, as issued, under NCCL's rules (their own communicator)
        traces = [None] * world
        dist.all_gather_object(traces, cp_traces(chunks))
        sliding = any(m.window is not None for c in chunks for m in c.modules() if isinstance(m, Attention))
        if rank == 0:  # a family without sliding layers exchanges no halo (all-gathers only)
            assert replay(dict(enumerate(traces))).operations > 0 or not sliding
    n = sum(int(b.num_target_tokens) for row in batches for b in row)
    assert m.num_targets == n and abs(m.loss - ref_loss) <= 1e-5 * abs(ref_loss), (step, m.loss, ref_loss)
    assert abs(m.grad_norm - float(ref_norm)) <= 1e-5 * float(ref_norm), (step, m.grad_norm, float(ref_norm))
    ref_imbalance = float(torch.stack([l.max() / l.mean() for l in loads]).mean())
    assert abs(m.moe_imbalance - ref_imbalance) <= 1e-6 * ref_imbalance, (step, m.moe_imbalance, ref_imbalance)

    clip_gradients(list(ref_model.parameters()), clip, ref_norm)
    ref_opt.step()
    ref = dict(ref_model.named_parameters())
    for c in chunks:
        for name, p, want, rows in global_params(c, ref):
            err = rel_err(p.grad, want.grad[rows])
            assert err < 1e-5, f"rank {rank} step {step}: gradient of {name} differs (relative {err:.2e})"
            assert rel_err(p.detach(), want.detach()[rows]) < 1e-5, f"step {step}: parameter {name} after it differs"
    if bias_rate:  # exact: signs of sums of whole token counts
        want_bias = expected_bias(ref_model, loads, bias_rate)
        for c in chunks:
            names = {id(mod): n for n, mod in c.named_modules()}
            for layer in c.moe_layers():
                got = layer.router.e_score_correction_bias
                assert torch.equal(got, want_bias[names[id(layer)]]), (step, names[id(layer)])
        names = {id(mod): n for n, mod in ref_model.named_modules()}
        for layer in ref_model.moe_layers():
            layer.router.e_score_correction_bias.copy_(want_bias[names[id(layer)]])

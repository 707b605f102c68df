"""Rank-side bodies of the parallel equivalence tests (importable by spawned processes)."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from core.distributed.grads import clip_gradients, grad_norm, reduce_step_loss, sync_gradients, tag_parameters
from core.parallel_state import ParallelSizes, ParallelState
from core.pipeline.executor import PipelineExecutor
from core.pipeline.schedules import build_schedule
from data.indexed_dataset import InMemoryDataset
from data.packing import plan_packs
from data.thd import build_thd_batch
from models.step37 import Step37Config, Step37Model
from models.step37.parallelize import build_chunks

SEQ = 48          # tokens per micro-batch (one pack)
MTP_SCALE = 0.3


def micro_batches(dp: int, M: int, vocab: int, seed: int = 0):
    """batches[d][m]: each a full THD pack of random documents (several per pack)."""
    out = []
    for d in range(dp):
        row = []
        for m in range(M):
            rng = np.random.default_rng([seed, d, m])
            lengths = rng.integers(2, 20, 8)
            docs = [rng.integers(0, vocab, n) for n in lengths]
            plan = plan_packs(lengths, SEQ, seed=0)
            row.append(build_thd_batch([plan.pack(0)], InMemoryDataset(docs), SEQ, pad_id=0))
        out.append(row)
    return out


def tiny_config(**kw) -> Step37Config:
    return Step37Config.from_hf(Step37Config.preset("tiny").to_hf(), **kw)


def reference(cfg, batches, aux_coeff, router_bias=None):
    """One process, every micro-batch of every DP rank: the objective the layouts must match."""
    model = Step37Model(cfg, seed=0)
    _set_bias(model, router_bias)
    flat = [b for row in batches for b in row]
    n = sum(int(b.num_target_tokens) for b in flat)
    loss_sum = 0.0
    for b in flat:
        out = model(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels)
        obj = (out.loss_sum + MTP_SCALE * sum(out.mtp_loss_sums)) / n
        if aux_coeff:
            obj = obj + aux_coeff * out.aux_loss / len(flat)
        obj.backward()
        loss_sum += float(out.loss_sum)
    return model, loss_sum / n


def _set_bias(model, router_bias):
    if router_bias is None:
        return
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(router_bias)


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def check_layout(rank, world, pp, vpp, ep, dispatcher="alltoall", aux_coeff=0.0, router_bias=None):
    cfg = tiny_config()
    sizes = ParallelSizes(world, pp=pp, ep=ep, vpp=vpp)
    ps = ParallelState.build(sizes, cfg.num_layers, cfg.num_experts)
    M = max(2, pp)
    batches = micro_batches(sizes.dp, M, cfg.vocab_size)
    ref_model, ref_loss = reference(cfg, batches, aux_coeff, router_bias)

    chunks = build_chunks(cfg, ps, dispatcher=dispatcher)
    for c in chunks:
        _set_bias(c, router_bias)
    mine = batches[ps.dp_rank]
    n = torch.tensor(sum(int(b.num_target_tokens) for row in batches for b in row))
    ex = PipelineExecutor(chunks, ps, seq_tokens=SEQ, hidden_size=cfg.hidden_size,
                          mtp_loss_scale=MTP_SCALE, aux_coeff=aux_coeff)
    stats = ex.run(build_schedule(pp, vpp, M)[ps.pp_rank], lambda m: mine[m], int(n), M * sizes.dp)
    params = tag_parameters(chunks, ps)
    sync_gradients(params, ps)

    ref = dict(ref_model.named_parameters())
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            want = ref[name]
            if ".moe.experts." in name:
                off = chunk.get_submodule(name.rsplit(".", 1)[0]).expert_offset
                assert torch.equal(p.detach(), want.detach()[off:off + p.shape[0]]), f"init differs: {name}"
                want_grad = want.grad[off:off + p.shape[0]]
            else:
                assert torch.equal(p.detach(), want.detach()), f"init differs: {name}"
                want_grad = want.grad
            err = rel_err(p.grad, want_grad) if want_grad.abs().max() > 0 else float(p.grad.abs().max())
            assert err < 1e-5, f"rank {rank}: gradient of {name} differs (relative {err:.2e})"

    loss, tokens, _ = reduce_step_loss(stats.loss_sum, stats.num_tokens)
    assert tokens == int(n) and abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    norm = grad_norm(params, ps)
    ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref_model.parameters()))
    assert abs(float(norm) - float(ref_norm)) <= 1e-5 * float(ref_norm), (float(norm), float(ref_norm))

    # one clipped SGD step on both sides gives the same parameters. (Not AdamW: its first update
    # is ~lr * sign(g), which turns 1e-7-relative noise in near-zero entries into full-size steps.)
    clip_gradients(params, 0.5 * float(ref_norm), norm)
    clip_gradients(list(ref_model.parameters()), 0.5 * float(ref_norm), ref_norm)
    for opt in (torch.optim.SGD(params, lr=0.5, momentum=0.9),
                torch.optim.SGD(ref_model.parameters(), lr=0.5, momentum=0.9)):
        opt.step()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            want = ref[name].detach()
            if ".moe.experts." in name:
                off = chunk.get_submodule(name.rsplit(".", 1)[0]).expert_offset
                want = want[off:off + p.shape[0]]
            assert rel_err(p.detach(), want) < 1e-5, f"parameter {name} after the step differs"
    dist.barrier()

"""--compile: fullgraph per decoder layer and MTP depth, equal to eager, no recompile per pack.

One rank here with inductor (real generated code); PP2 x EP2 (the all-to-all outside the
graphs) is in tests/distributed/test_parallel_equivalence.py."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config

from core.compile import apply_compile
from tests.unit.numerics import assert_close_rel
from tests.unit.test_model_hf import thd
from tests.unit.test_model_thd import labels_for, tiny

PACKS = [[9, 3, 14, 1, 11], [20, 18], [5, 5, 5, 5, 5, 13]]  # 38 tokens each, other boundaries


def _train(model, packs, first_seed=0):
    """SGD steps, one per pack; the losses and the final parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for i, lengths in enumerate(packs, start=first_seed):
        tokens, pos, psp = thd(lengths, seed=i)
        out = model(tokens, pos, psp, labels=labels_for(tokens, lengths))
        loss = (out.loss_sum + 0.3 * sum(out.mtp_loss_sums) + 0.01 * out.aux_loss) / out.num_tokens
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_inductor_trains_like_eager_without_recompiling():
    torch._dynamo.reset()
    eager_losses, eager_params = _train(tiny("sdpa"), PACKS)
    model = tiny("sdpa")
    assert apply_compile(model, "inductor") == 6  # 4 layers + 2 MTP depths, each one graph
    counters = torch._dynamo.utils.counters
    # gcc in this process: a pool of compile workers (the default on two or more cores) first
    # starts an interpreter that imports torch, ~5 CPU-s of a cold ~60 (the same generated code);
    # scalar C++ kernels built at -O0 (inductor's debug_compile): the same lowering, fusion and
    # graphs without the ISA probes (ten interpreters that import torch), vector code and gcc's
    # optimiser, 82 s cold down to 52 here (a GPU run generates Triton, not these)
    with torch._inductor.config.patch(compile_threads=1, **{"cpp.vec_isa_ok": False, "aot_inductor.debug_compile": True}):
        losses, _ = _train(model, PACKS[:1])
    graphs = dict(counters["stats"])
    assert graphs["unique_graphs"] >= 3  # dense, MoE and MTP blocks differ
    more_losses, params = _train(model, PACKS[1:], first_seed=1)
    assert dict(counters["stats"]) == graphs, "a new pack recompiled a layer"
    # fp32; inductor fuses and reorders reductions (RMSNorm, softmax, SwiGLU): measured 7.6e-8
    # relative on the losses and 6.8e-7 (of each tensor's largest entry) on the parameters
    # after 3 steps; 1e-5 leaves ~15x
    assert_close_rel(torch.tensor(losses + more_losses), torch.tensor(eager_losses), rel=1e-5)
    errs = {n: ((p - eager_params[n]).abs().max() / eager_params[n].abs().max()).item()
            for n, p in params.items()}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, (worst, errs[worst])


def test_a_host_read_inside_a_layer_fails_loudly():
    torch._dynamo.reset()
    model = tiny("sdpa")
    layer = model.layers["0"]
    norm_forward = layer.input_layernorm.forward

    def with_host_read(x):
        if float(x.sum()) > -1e30:  # a value read on the host: a graph break
            return norm_forward(x)
        return x

    layer.input_layernorm.forward = with_host_read
    apply_compile(model, "aot_eager")
    tokens, pos, psp = thd([9, 3, 14], seed=0)
    with pytest.raises(Exception, match="(?i)graph break|data-dependent|Unsupported"):
        model(tokens, pos, psp)


@pytest.mark.parametrize("backend", ["flex", "transformer_engine"])
def test_backends_that_stay_eager_are_refused(backend):
    with pytest.raises(ValueError, match=f"--compile does not support --attention-backend {backend} "):
        apply_compile(tiny(backend), "aot_eager")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="--compile-backend 'tvm': expected one of inductor, aot_eager, eager"):
        apply_compile(tiny("sdpa"), "tvm")


def test_the_expert_loop_compiles_as_one_opaque_op():
    """The per-expert loop (what fp32 experts use on CUDA, where grouped_mm wants bf16) reads
    its segment sizes on the host: inside a compiled layer that read happens within one custom
    op, so the layer stays one graph and its gradients equal eager's exactly (aot_eager)."""
    from core.moe.experts import GroupedExperts

    torch._dynamo.reset()
    eager, model = tiny("sdpa"), tiny("sdpa")
    for m in list(eager.modules()) + list(model.modules()):
        if isinstance(m, GroupedExperts):
            m.use_grouped_mm = False
    assert apply_compile(model, "aot_eager") == 6
    for i, lengths in enumerate(PACKS[:2]):
        tokens, pos, psp = thd(lengths, seed=i)
        grads = []
        for m in (eager, model):
            m.zero_grad()
            out = m(tokens, pos, psp, labels=labels_for(tokens, lengths))
            (out.loss_sum + sum(out.mtp_loss_sums)).backward()
            grads.append([p.grad for p in m.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recomputed_blocks_and_mtp_depths_compile_whole_and_equal_eager(granularity):
    """Recompute inside the compiled blocks (checkpoint traced into the graph; an MTP depth's
    chunked loss an opaque op beside it): still one graph per block, no graph break, and the
    gradients of eager exactly (aot_eager runs the same kernels)."""
    from core.transformer.block import apply_recompute

    torch._dynamo.reset()
    eager, model = tiny("sdpa"), tiny("sdpa")
    for m in (eager, model):
        apply_recompute(m, granularity)
    assert apply_compile(model, "aot_eager") == 6
    tokens, pos, psp = thd(PACKS[0], seed=0)
    grads = []
    for m in (eager, model):
        out = m(tokens, pos, psp, labels=labels_for(tokens, PACKS[0]))
        (out.loss_sum + sum(out.mtp_loss_sums)).backward()
        grads.append([p.grad for p in m.parameters()])
    assert not torch._dynamo.utils.counters["graph_break"]
    assert all(torch.equal(a, b) for a, b in zip(*grads))

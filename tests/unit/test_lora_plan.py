"""The planner under LoRA (``--lora-rank``): the frozen base costs its stored copy only (2 bytes
per parameter under --bf16, its fp32 routers 4), the adapters their fp32 parameter, gradient and
AdamW state; the backward skips the frozen weights' gradient GEMMs and adds the adapters'; the
search plans LoRA layouts with the modes MemoryMode.check_lora accepts, and for Step-3.7-Flash
on 8 x H200 ranks first a layout without offload that leaves 10 GB free."""
from __future__ import annotations

import torch

from core.finetune.lora import LoraSettings, adapter_params, apply_lora
from core.moe.router import TopKRouter
from core.costs.shapes import AttentionShape, BlockShape, FFNShape
from models.step37 import Step37Config
from models.step37.model import Step37Model
from tests.planner_inputs import inputs
from training.planner.memory import plan
from training.planner.search import candidates
from training.planner.lora import adapter_flops
from training.planner.timing import plan_time

TINY = Step37Config.preset("tiny")


def _counts():
    """(frozen bf16 parameters, frozen fp32 router parameters, adapter parameters, adapter
    tensors) of the whole tiny model, counted from the modules."""
    with torch.device("meta"):
        model = Step37Model(TINY)
    apply_lora(model, LoraSettings(lora_rank=4))
    adapters = adapter_params(model)
    routers = {id(p) for m in model.modules() if isinstance(m, TopKRouter) for p in m.parameters()}
    ps = list(model.parameters())
    return (sum(p.numel() for p in ps if id(p) not in adapters and id(p) not in routers),
            sum(p.numel() for p in ps if id(p) in routers),
            sum(p.numel() for p in ps if id(p) in adapters), sum(1 for p in ps if id(p) in adapters))


def test_lora_memory_is_the_frozen_base_in_bf16_and_the_adapters_state():
    base_bf16, routers, adapters, tensors = _counts()
    inp = inputs(seq_length=64, optimizer="adamw", bf16=True, lora_rank=4, num_microbatches=1)
    rank = plan(TINY, inp)[0]
    assert rank.device["parameters"] == 2 * base_bf16 + 4 * routers + 4 * adapters
    assert rank.device["gradients"] == 4 * adapters
    assert rank.device["optimizer"] == 8 * adapters + 4 * tensors  # AdamW's two moments and its step
    full = plan(TINY, inputs(seq_length=64, optimizer="adamw", bf16=True, num_microbatches=1))[0]
    assert full.device["parameters"] == 4 * (base_bf16 + routers)


def test_adapter_flops_hand_worked():
    """Attention with 4 heads of 16, 2 KV heads and a gate at hidden 64, rank 4: q 64 -> 64,
    k and v 64 -> 32, o 64 -> 64, gate 64 -> 4: 2 x 4 x (128 + 96 + 96 + 128 + 68) = 4,128; an MoE
    FFN (top-2 of experts of 32, shared 48): experts 2 x 3 x (64 + 32) = 576 ends, shared
    3 x (64 + 48) = 336 ends."""
    b = BlockShape(AttentionShape(heads=4, kv_heads=2, head_dim=16, gate=True),
                   FFNShape("moe", 32, experts=8, top_k=2, shared=48))
    assert adapter_flops(64, b, 4, {"attention"}) == 4128
    assert adapter_flops(64, b, 4, {"experts"}) == 8 * 576
    assert adapter_flops(64, b, 4, {"shared_expert", "mlp"}) == 8 * 336
    assert adapter_flops(64, b, 4, {"mlp"}) == 0  # no dense MLP in an MoE block


def test_lora_backward_skips_the_frozen_weight_gradients():
    kw = dict(seq_length=64, optimizer="adamw", bf16=True, num_microbatches=1)
    full, lora = plan_time(TINY, inputs(**kw)), plan_time(TINY, inputs(lora_rank=4, **kw))
    assert lora.ranks[0].seconds["compute"] < full.ranks[0].seconds["compute"]
    assert lora.ranks[0].seconds["optimizer"] < full.ranks[0].seconds["optimizer"]


def test_search_plans_lora_with_the_modes_it_allows():
    cfg = Step37Config.preset("step37-flash")
    base = inputs(seq_length=8192, optimizer="adamw", bf16=True, lora_rank=32)
    todo = candidates(cfg, 8, base, 32)
    assert todo and all(c.lora_rank == 32 for c in todo)
    assert {c.mode.cpu_offload for c in todo} == {"none", "experts", "all"}
    assert not any(c.mode.store_param_remainders or c.mode.optimizer_in_backward or c.mode.recompute_chunks > 1
                   for c in todo)
    assert not candidates(cfg, 8, inputs(seq_length=8192, optimizer="muon", bf16=True, lora_rank=32), 32)


def test_lora_recipe_runs_the_search_top_row(tmp_path):
    """examples/step37_flash_8xh200_lora_sft.sh: its layout flags are the LoRA search's fastest
    fitting layout for Step-3.7-Flash on 8 x H200 (searched in this process), with no offload
    and 10 GB to spare."""
    from tests.unit.test_plan_cli import _assert_recipe_is_the_search_top_row

    wanted = _assert_recipe_is_the_search_top_row(tmp_path, Step37Config, "step37-flash",
                                                  "step37_flash_8xh200_lora_sft.sh", 141 - 10)
    assert "--cpu-offload" not in wanted


def test_h100_lora_recipe_runs_the_80gb_search_top_row(tmp_path):
    """examples/step37_flash_8xh100_lora_sft.sh: the LoRA search's fastest fitting layout on 8 GPUs
    of 80 GB (5 GB to spare): the frozen experts offloaded to host memory."""
    from tests.unit.test_plan_cli import _assert_recipe_is_the_search_top_row

    wanted = _assert_recipe_is_the_search_top_row(tmp_path, Step37Config, "step37-flash",
                                                  "step37_flash_8xh100_lora_sft.sh", 80 - 5, gpu_gb=80)
    assert wanted[wanted.index("--cpu-offload") + 1] == "experts"


def test_frozen_layers_keep_what_the_planner_books():
    """A frozen block keeps less for its backward: no normalised output of a frozen norm, no
    input of a frozen projection without an adapter (``core.costs.activations.frozen_savings``).
    Measured on the tiny model's last decoder layer (full attention, MoE with a shared expert;
    earlier adapters make its input require a gradient) for each target set: the planner's
    block within 25% of what autograd saved (the base formula's bound), and its saving against
    the full block within 25% of the measured saving (the part LoRA changes)."""
    from core.costs.activations import block_bytes, cpu_sdpa_extra_bytes
    from core.costs.saved_bytes import SavedTensorBytes
    from core.parallel_state import ParallelState
    from models.registry import shapes_of
    from tests.unit.test_memory_plan import labels_for, thd
    from training.parallelize import build_chunks

    docs, i, shapes = [100, 100, 56], 3, shapes_of(TINY)
    assert TINY.mlp_layer_types[i] == "sparse" and TINY.layer_types[i] == "full_attention"
    extra = cpu_sdpa_extra_bytes(shapes.blocks[i].attention, docs, 4, 1)  # CPU SDPA on top of a fused kernel

    def measured(targets: str | None) -> int:
        chunk = build_chunks(TINY, ParallelState.single())[0]
        if targets:
            apply_lora(chunk, LoraSettings(lora_rank=4, lora_alpha=8, lora_targets=targets))
        saved = SavedTensorBytes(chunk)
        layer = chunk.layers[str(i)]
        layer.register_forward_pre_hook(lambda m, a: saved.__enter__() and None)
        layer.register_forward_hook(lambda m, a, o: saved.__exit__(None, None, None))
        tokens, pos, psp = thd(docs)
        chunk(tokens, pos, psp, labels=labels_for(tokens, docs))
        return saved.bytes

    full, full_est = measured(None), block_bytes(shapes, i, 256, 4) + extra
    for targets in ("attention", "attention,shared_expert", "attention,experts", "attention,mlp,shared_expert,experts"):
        got, est = measured(targets), block_bytes(shapes, i, 256, 4, "none", (4, targets)) + extra
        assert 0.75 <= est / got <= 1.25, (targets, est, got)
        assert 0.75 <= (full_est - est) / (full - got) <= 1.25, (targets, full_est - est, full - got)


def test_a_frozen_base_reruns_its_lora_activations_and_the_heads_are_freed_before_the_layers(monkeypatch):
    """Under full recompute a layer's backward reruns its forward and holds what that forward
    keeps: under LoRA the frozen base's (``block_bytes`` with the adapters' ``lora``), not the
    trained one's (the plan booked 2.8 GB too many for Step-3.7-Flash's MoE layer at 4 packs).
    And the backward runs the heads and MTP depths before the decoder layers, freeing what they
    kept, so the largest layer's working set never meets those bytes: the plan's overlap grows
    by the largest layer's set less the larger of it without them and the depths' sets."""
    from core.costs.activations import block_bytes, extra_block_bytes, head_bytes
    from models.registry import shapes_of

    shapes, T, b, lora = shapes_of(TINY), 64, 2, (4, "attention,mlp,shared_expert,experts")
    kw = dict(seq_length=T, optimizer="adamw", bf16=True, num_microbatches=2, recompute_granularity="full")
    trained, frozen = plan(TINY, inputs(**kw))[0], plan(TINY, inputs(lora_rank=4, **kw))[0]
    layers = [block_bytes(shapes, i, T, b, "none", lora) - T * TINY.hidden_size * b for i in range(TINY.num_layers)]
    depths = [extra_block_bytes(shapes, k, T, b, "none", lora) - extra_block_bytes(shapes, k, T, b, "full")
              for k in range(len(shapes.extra))]
    assert frozen.device["recompute working set"] == max(layers + depths) < trained.device["recompute working set"]
    heads = head_bytes(shapes, T, b) + sum(extra_block_bytes(shapes, k, T, b, "full") for k in range(len(shapes.extra)))
    assert max(layers) > max(max(layers) - heads, *depths)  # the tiny model's largest set is a layer's
    from training.planner import memory

    monkeypatch.setattr(memory, "_kept_after_layers", lambda *a: 0)  # as if the heads kept theirs
    kept_whole = plan(TINY, inputs(lora_rank=4, **kw))[0]
    assert frozen.overlap - kept_whole.overlap == max(layers) - max(max(layers) - heads, *depths) > 0

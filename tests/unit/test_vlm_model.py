"""The Step-3.7 vision-language model on packed image + text THD micro-batches, against
transformers' Step3p7ForConditionalGeneration run on each document alone (fp32, CPU, a tiny
random config with a 2-layer vision tower: the "step37-tiny-vlm" preset).

Tolerance HF_REL, relative to the largest value compared: the same terms summed in other orders
(per-document SDPA vs transformers' mask, grouped GEMM vs a per-expert loop, a fused qkv GEMM in
the checkpoint's interleaved RoPE channel order vs transformers' split, permuted projections).
Measured over 5 seeds: logits <= 3.3e-6, loss sums <= 1e-7 (relative); 4e-5 (the text model's
bar, tests/unit/test_model_hf.py) leaves > 10x margin.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.packed_seq import ImageInputs, PackedSeqParams
from models.step37 import Step37Config, Step37Model
from tests.unit.hf_reference import randomize
from tests.unit.numerics import assert_close_rel

HF_REL = 4e-5
IMG = 3                        # the preset's image placeholder token (the test processor's <im_patch>)
GLOBAL, CROP = 112, 84         # view sizes (pixels): 4 features each after the downsamplers
SEQ = 64                       # one pack; its documents fill 53 tokens, the rest is padding


def _hf_model(seed: int):
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    raw = Step37Config.preset("step37-tiny-vlm").to_hf()
    cfg = Step3p7Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    hf = Step3p7ForConditionalGeneration(cfg).eval()
    randomize(hf, seed)
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm") / "hf"
    hf = _hf_model(seed=1)
    hf.save_pretrained(str(path))
    return str(path), hf


def _text(g, n):
    return torch.randint(9, 300, (n,), generator=g)  # no special token (0..8: the processor's)


def documents(seed=0):
    """Three documents: text, an image with 2 crops, text; text, an image without crops, text,
    an image with 1 crop, text; text only. Each: (tokens, [(global [3,S,S], crops [k,3,P,P])])."""
    g = torch.Generator().manual_seed(seed)
    cfg = Step37Config.preset("step37-tiny-vlm").vision

    def image(crops):
        n = crops * cfg.features(CROP) + cfg.features(GLOBAL)
        return (torch.randn(3, GLOBAL, GLOBAL, generator=g), torch.randn(crops, 3, CROP, CROP, generator=g)), \
            torch.full((n,), IMG)

    a1, ta1 = image(2)
    b1, tb1 = image(0)
    b2, tb2 = image(1)
    return [(torch.cat([_text(g, 5), ta1, _text(g, 6)]), [a1]),
            (torch.cat([_text(g, 3), tb1, _text(g, 4), tb2, _text(g, 2)]), [b1, b2]),
            (_text(g, 9), [])]


def labels_of(tokens):
    """Next token of the document; none at its end and none that is an image placeholder."""
    lab = torch.full_like(tokens, -100)
    lab[:-1] = tokens[1:]
    lab[lab == IMG] = -100
    return lab


def image_inputs(images, positions) -> ImageInputs | None:
    if not images:
        return None
    crops = [c for _, c in images if c.shape[0]]
    return ImageInputs(torch.stack([g for g, _ in images]), torch.cat(crops) if crops else None,
                       tuple(c.shape[0] for _, c in images), positions)


def pack(docs):
    """One THD micro-batch of SEQ tokens (the trailing pad folded into the last document)."""
    tokens = torch.zeros(SEQ, dtype=torch.int64)
    labels = torch.full((SEQ,), -100, dtype=torch.int64)
    positions = torch.zeros(SEQ, dtype=torch.int64)
    cu, at = [0], 0
    for t, _ in docs:
        tokens[at:at + len(t)], labels[at:at + len(t)] = t, labels_of(t)
        positions[at:at + len(t)] = torch.arange(len(t))
        at += len(t)
        cu.append(at)
    positions[at:] = torch.arange(SEQ - at) + len(docs[-1][0])
    cu_t = torch.tensor(cu, dtype=torch.int32)
    pad = cu_t.clone()
    pad[-1] = SEQ
    images = [im for _, ims in docs for im in ims]
    psp = PackedSeqParams(cu_t, pad, max(len(t) for t, _ in docs))
    return tokens, labels, positions, psp, image_inputs(images, (tokens == IMG).nonzero()[:, 0])


def hf_document(hf, tokens, images):
    kw = {}
    if images:
        kw = dict(pixel_values=torch.stack([g for g, _ in images]),
                  pixel_values_local=torch.cat([c for _, c in images]) if any(c.shape[0] for _, c in images) else None,
                  num_local_patches=[c.shape[0] for _, c in images])
    return hf(input_ids=tokens[None], **kw).logits[0]


def ours(path, **overrides):
    model = Step37Model(Step37Config.from_hf(path, **overrides))
    report = model.load_hf(path, strict=False)
    assert report["unexpected"] == [] and report["misshaped"] == []
    assert all(n.startswith("mtp.") for n in report["missing"])  # transformers has no MTP weights
    return model


def test_packed_image_text_logits_and_loss_equal_transformers_per_document(checkpoint):
    path, hf = checkpoint
    model = ours(path)
    docs = documents()
    tokens, labels, pos, psp, images = pack(docs)
    with torch.no_grad():
        logits = model(tokens, pos, psp, images=images)
        out = model(tokens, pos, psp, labels=labels, images=images)
        ref_sum, at = torch.zeros((), dtype=torch.float64), 0
        for t, ims in docs:
            ref = hf_document(hf, t, ims)
            assert_close_rel(logits[at:at + len(t)], ref, rel=HF_REL)
            ref_sum += F.cross_entropy(ref.double(), labels_of(t), ignore_index=-100, reduction="sum")
            at += len(t)
    assert int(out.num_tokens) == int((labels != -100).sum())
    assert abs(float(out.loss_sum) - float(ref_sum)) <= HF_REL * abs(float(ref_sum))


def test_export_reloads_in_transformers_with_the_same_logits(checkpoint, tmp_path):
    """Trained vision weights (perturbed here) leave by their published names: transformers
    reads the export whole and gives our logits; our reload restores every tensor."""
    from transformers import Step3p7ForConditionalGeneration

    path, _ = checkpoint
    model = ours(path)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for name, p in model.named_parameters():
            if name.startswith(("vision_model.", "multi_modal_projector.")):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    assert model.save_hf(str(tmp_path / "out")) == "published"
    hf, info = Step3p7ForConditionalGeneration.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    docs = documents(seed=3)
    tokens, _, pos, psp, images = pack(docs)
    with torch.no_grad():
        logits, at = model(tokens, pos, psp, images=images), 0
        for t, ims in docs:
            assert_close_rel(logits[at:at + len(t)], hf_document(hf.eval(), t, ims), rel=HF_REL)
            at += len(t)
    again = ours(str(tmp_path / "out"))
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert n.startswith("mtp.") or torch.equal(p, q), n


def test_one_documents_image_changes_no_other_document(checkpoint):
    """A new image in document 1: documents 0 and 2 keep their logits and the gradients of their
    loss (document 1's targets masked), the vision tower's included; document 1's change."""
    path, _ = checkpoint
    model = ours(path)
    docs = documents()
    other = [(docs[1][0], [(g + 1.0, c * 0.5) for g, c in docs[1][1]])]
    runs = []
    for d in (docs, [docs[0], *other, docs[2]]):
        tokens, labels, pos, psp, images = pack(d)
        a, b = psp.host_cu_seqlens[1], psp.host_cu_seqlens[2]
        labels[a:b] = -100
        model.zero_grad()
        out = model(tokens, pos, psp, labels=labels, images=images)
        out.loss_sum.backward()
        with torch.no_grad():
            logits = model(tokens, pos, psp, images=images)
        runs.append((logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, a, b))
    (l0, g0, a, b), (l1, g1, _, _) = runs
    keep = torch.ones(SEQ, dtype=torch.bool)
    keep[a:b] = False
    # measured: exactly equal on CPU; a tolerance because the MoE's expert group sizes change
    # with document 1's routing, which may change GEMM blocking (a summation order) elsewhere
    assert_close_rel(l1[keep], l0[keep], rel=1e-6)
    assert (l1[a:b] - l0[a:b]).abs().max() > 1e-3
    assert g0.keys() == g1.keys() and any(n.startswith("vision_model.") for n in g0)
    for n in g0:
        assert_close_rel(g1[n], g0[n], rel=1e-5)


def test_text_only_packs_are_unchanged(checkpoint):
    """Without images, the VLM gives bit for bit the text decoder's logits and loss, without
    running its tower (no vision gradient) or, given an idle ImageInputs, running it on a zero
    patch (every vision parameter a zero gradient), so data-parallel ranks without images run
    the same collectives as one with."""
    path, _ = checkpoint
    vlm, text = ours(path), ours(path, vision=None)
    assert text.vision_model is None and not any(n.startswith("vision_model.") for n, _ in text.named_parameters())
    docs = [d for d in documents() if not d[1]] * 3
    tokens, labels, pos, psp, images = pack(docs)
    assert images is None
    with torch.no_grad():
        assert torch.equal(vlm(tokens, pos, psp), text(tokens, pos, psp))
    a, b = vlm(tokens, pos, psp, labels=labels), text(tokens, pos, psp, labels=labels)
    assert torch.equal(a.loss_sum, b.loss_sum)
    a.loss_sum.backward()
    vision = [p for n, p in vlm.named_parameters() if n.startswith(("vision_model.", "multi_modal_projector."))]
    assert vision and all(p.grad is None for p in vision)
    assert sorted(map(id, vlm.image_parameters())) == sorted(map(id, vision))
    idle = vlm(tokens, pos, psp, labels=labels, images=ImageInputs.idle())
    assert torch.equal(idle.loss_sum, b.loss_sum)
    idle.loss_sum.backward()
    assert all(p.grad is not None and not p.grad.any() for p in vision)
    t2, _, p2, psp2, im2 = pack(documents())
    with pytest.raises(ValueError, match="has no vision tower"):
        text(t2, p2, psp2, images=im2)


def test_parts_specs_and_units_cover_the_vision_tower():
    cfg = Step37Config.preset("step37-tiny-vlm")
    with torch.device("meta"):
        first, later = Step37Model(cfg, layers=[0, 1], last=False), Step37Model(cfg, layers=[2, 3], first=False)
    assert later.vision_model is None and later.multi_modal_projector is None
    parts = first.param_parts()
    assert parts["projector"] == ["multi_modal_projector.weight"]
    assert len(parts["vision"]) == 8 + 2 * 14 and "embed_tokens.weight" in parts["language"]
    assert sorted(sum(parts.values(), [])) == sorted(n for n, _ in first.named_parameters())
    specs = first.param_specs()
    assert specs["vision_model.pos_embed"].role == "embedding"           # AdamW, not Muon
    assert specs["vision_model.downsample1.weight"].role == "embedding"  # 4-D kernel
    assert specs["vision_model.blocks.0.attn.qkv.weight"].role == "weight"
    units = [u.module for u in first.fsdp_units()]
    assert units[:4] == [*first.vision_model.blocks, first.vision_model, first.multi_modal_projector]
    owner = {}  # each parameter's innermost unit (the chunk itself: the root)
    for unit in [*units, first][::-1]:
        owner.update({id(p): id(unit) for p in unit.parameters()})
    part_of = {id(p): part for part, names in parts.items() for n, p in first.named_parameters() if n in names}
    for unit in {*owner.values()}:
        assert len({part_of[p] for p, u in owner.items() if u == unit}) == 1  # one part per unit
    assert Step37Config.from_hf(cfg.to_hf()) == cfg and Step37Config(**cfg.to_dict()) == cfg


def test_feature_count_mismatch_is_a_clear_error(checkpoint):
    model = ours(checkpoint[0])
    tokens, _, pos, psp, images = pack(documents())
    images.feature_positions = images.feature_positions[:-1]
    with pytest.raises(ValueError, match="give 24 features but the micro-batch has 23 image placeholder"):
        model(tokens, pos, psp, images=images)
    # a CP shard's images: checked against the pack's feature count (a host int), not the shard's
    cp = ImageInputs(images.pixel_values, images.pixel_values_local, images.num_local_patches,
                     torch.tensor([0, 1]), torch.tensor([5, 6]), num_features=25)
    with pytest.raises(ValueError, match="give 24 features but the micro-batch has 25 image placeholder"):
        model(tokens, pos, psp, images=cp)
    with pytest.raises(ValueError, match="num_features"):
        ImageInputs(images.pixel_values, images.pixel_values_local, images.num_local_patches,
                    torch.tensor([0, 1]), torch.tensor([5, 6]))


def test_train_step_takes_images_from_the_micro_batch(checkpoint):
    """core.train_step on one process: THDBatch.images reach the first stage through the
    pipeline executor; loss and gradients (tower included) are those of the model called
    directly, over a micro-batch with images and one without."""
    import copy

    from core.parallel_state import ParallelSizes, ParallelState
    from core.train_step import StepSettings, train_step
    from data.thd import THDBatch

    model = ours(checkpoint[0])
    ref = copy.deepcopy(model)
    batches = []
    for docs in (documents(seed=5), [d for d in documents(seed=6) if not d[1]]):
        tokens, labels, pos, psp, images = pack(docs)
        batches.append(THDBatch(tokens, labels, pos, psp, images))
    n = sum(b.num_target_tokens for b in batches)
    total = 0.0
    for b in batches:
        out = ref(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels, images=b.images)
        (out.loss_sum / n).backward()
        total += float(out.loss_sum.detach())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    m = train_step([model], ParallelState(ParallelSizes(1), 0, {}), opt, batches,
                   StepSettings(hidden_size=model.config.hidden_size, mtp_depths=model.config.num_mtp_layers))
    assert abs(m.loss - total / n) <= 1e-6 * abs(total / n)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = grads[name].grad  # None: the MTP depths, whose losses weigh 0 here
        if want is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            assert_close_rel(p.grad, want, rel=1e-6)  # the same operations
    assert model.vision_model.blocks[0].attn.qkv.weight.grad.abs().max() > 0


@pytest.mark.parametrize("optimizer", ["adamw", "muon_in_backward"])
def test_a_step_without_images_on_any_rank_skips_the_tower_bitwise(checkpoint, monkeypatch, optimizer):
    """core.train_step, two text-only steps: no rank of the group has an image, so the tower's
    forward is never called, and losses and parameters equal bit for bit those of the idle pass
    (forced here by the step's host all-reduce reporting an image on another rank): the tower's
    parameters step on a zero gradient either way (AdamW: weight decay and moments; Muon inside
    the backward under --optimizer-in-backward: weight decay)."""
    import copy
    from types import SimpleNamespace

    import core.train_step as ts
    from core.model_api import specs_of
    from core.optim.build import build_optimizer
    from core.optim.in_backward import InBackwardSteps
    from core.parallel_state import ParallelSizes, ParallelState
    from data.thd import THDBatch

    base = ours(checkpoint[0])
    ps = ParallelState(ParallelSizes(1), 0, {})
    cfg = SimpleNamespace(optimizer=optimizer.split("_")[0], lr=1e-2, adamw_lr=1e-2, weight_decay=0.1,
                          adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, muon_momentum=0.0, muon_nesterov=True,
                          muon_ns_steps=5, muon_ns_method="quintic", muon_lr_adjust="rms", muon_ns_dtype="fp32",
                          dion_momentum=0.9, dion_rank_fraction=0.5)
    seeds = (7, 8) if optimizer == "adamw" else (7,)  # Newton-Schulz in fp32 is slow on the CPU
    text = [[THDBatch(*pack([d for d in documents(seed=s) if not d[1]] * 3)[:4], None)] for s in seeds]
    real = ts._global_counts
    runs = {}
    for skip in (True, False):
        if not skip:  # another rank of the group has an image: this one runs the tower idle
            monkeypatch.setattr(ts, "_global_counts", lambda *a: (*real(*a)[:3], 1))
        model = copy.deepcopy(base)
        opt, _ = build_optimizer([model], cfg)
        if optimizer == "muon_in_backward":
            opt.in_backward = InBackwardSteps(opt.optimizers["muon"], specs_of([model]), ps)
        calls = []
        model.vision_model.register_forward_pre_hook(lambda *a: calls.append(1))
        s = ts.StepSettings(hidden_size=model.config.hidden_size, mtp_depths=model.config.num_mtp_layers)
        losses = [ts.train_step([model], ps, opt, batches, s).loss for batches in text]
        runs[skip] = losses, dict(model.named_parameters()), len(calls)
    (losses, params, calls), (idle_losses, idle_params, idle_calls) = runs[True], runs[False]
    assert calls == 0 and idle_calls == len(seeds)
    assert losses == idle_losses
    for n, p in params.items():
        assert torch.equal(p, idle_params[n]), n
    qkv = "vision_model.blocks.0.attn.qkv.weight"  # a Muon matrix under muon_in_backward
    assert not torch.equal(params[qkv], dict(base.named_parameters())[qkv])  # decayed by a zero-gradient step


def test_mtp_depths_embed_the_placeholder_tokens_not_the_image_features(checkpoint):
    """Each MTP depth combines the trunk's hidden state with the embedding of the token k ahead:
    for an image placeholder that is the <im_patch> token's embedding, as transformers' MtpModel
    embeds its drafting inputs (docs/vlm.md, "MTP depths and images"), not the image's feature."""
    model = ours(checkpoint[0])
    tokens, labels, pos, psp, images = pack(documents())
    seen = {}
    for k, depth in model.mtp.items():
        depth.enorm.register_forward_pre_hook(lambda m, a, k=k: seen.setdefault(k, a[0].detach()))
    with torch.no_grad():
        model(tokens, pos, psp, labels=labels, images=images)
        features = model.embed(tokens, images)
    placeholder = model.embed_tokens.weight[IMG]
    assert set(seen) == set(model.mtp) and len(seen) == 2
    for k, x in seen.items():
        shift = int(k) + 1  # depth k (from 0) reads the token k + 1 ahead; all image runs lie inside documents
        at = (tokens == IMG).nonzero()[:, 0] - shift
        at = at[(at >= 0) & (tokens[at + shift] == IMG) & (pos[at + shift] == pos[at] + shift)]
        assert len(at) > 0
        assert torch.equal(x[at], placeholder.expand(len(at), -1))
        assert not torch.equal(x[at], features[at + shift])  # the tower's features are elsewhere


def test_vision_flops_count_what_the_tower_runs():
    """The planner's vision FLOPs (core.costs.flops.vision_view_flops of the config's shape) equal
    torch's FLOP counter on the tower and projector (on meta: every GEMM, convolution and
    attention product counted, nothing run)."""
    from torch.utils.flop_counter import FlopCounterMode

    from core.costs.flops import vision_view_flops
    from models.step37.costs import vision_shape

    cfg = Step37Config.preset("step37-tiny-vlm")
    with torch.device("meta"):
        model = Step37Model(cfg)
    for side in (GLOBAL, CROP, 70):
        with FlopCounterMode(display=False) as counter:
            model.multi_modal_projector(model.vision_model([torch.zeros(1, 3, side, side, device="meta")])[0])
        assert counter.get_total_flops() == sum(vision_view_flops(vision_shape(cfg), side).values())


def test_flash_vlm_preset_has_transformers_vision_parameter_count():
    from transformers import Step3p7VisionConfig, Step3p7VisionModel

    cfg = Step37Config.preset("step37-flash-vlm")
    with torch.device("meta"):
        hf = Step3p7VisionModel(Step3p7VisionConfig())
        first = Step37Model(cfg, layers=[0], last=False)
    parts = dict(first.named_parameters())
    ours = sum(parts[n].numel() for part in ("vision", "projector") for n in first.param_parts()[part])
    assert ours == sum(p.numel() for p in hf.parameters()) + 4 * 1536 * 4096  # + the projector
    assert cfg.image_token_id is None and "image_token_id" not in cfg.to_hf()


def test_image_features_in_bf16_follow_transformers(checkpoint):
    """Both models cast to bf16 (what FSDP's mixed precision computes in): the projected image
    features (two images, 2 and 1 crops) agree to bf16 rounding. Ours rotates q and k with fp32
    angles as transformers does; the fused qkv GEMM and the channel order round differently:
    measured 4.8e-3 of the largest feature (bf16's epsilon is 7.8e-3), bar 2e-2."""
    import copy

    from models.step37.vision import image_features

    path, hf = checkpoint
    model = ours(path).to(torch.bfloat16)
    hf = copy.deepcopy(hf).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    pix, crops = torch.randn(2, 3, GLOBAL, GLOBAL, generator=g), torch.randn(3, 3, CROP, CROP, generator=g)
    images = ImageInputs(pix, crops, (2, 1), torch.arange(20))
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(pix.bfloat16(), crops.bfloat16(), [2, 1]).pooler_output)
        got = image_features(model.vision_model, model.multi_modal_projector, images)
    assert got.dtype == torch.bfloat16
    assert_close_rel(got.float(), ref.float(), rel=2e-2)


def test_vision_layers_recompute_with_the_decoder(checkpoint):
    """apply_recompute gives the tower's layers the same granularity: the same loss and
    gradients, and a forward through the tower keeps less for backward (full: only each
    layer's input)."""
    from core.costs.saved_bytes import SavedTensorBytes
    from core.transformer.block import apply_recompute

    model = ours(checkpoint[0])
    tokens, labels, pos, psp, images = pack(documents())
    results = {}
    for granularity in ("none", "selective", "full"):
        apply_recompute(model, granularity)
        assert {b.recompute for b in model.vision_model.blocks} == {granularity}
        model.zero_grad()
        model(tokens, pos, psp, labels=labels, images=images).loss_sum.backward()
        with SavedTensorBytes(model) as saved:
            model.vision_model([images.pixel_values, images.pixel_values_local])
        results[granularity] = ({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                                saved.bytes)
    (none, b_none), (sel, b_sel), (full, b_full) = results.values()
    assert b_full < b_sel < b_none
    for grads in (sel, full):
        assert grads.keys() == none.keys()
        for n in none:
            assert_close_rel(grads[n], none[n], rel=1e-6)  # the same maths rerun


def test_vision_config_reads_the_hub_form_and_refuses_other_designs():
    from models.step37.vision_config import Step37VisionConfig

    hub = {"model_type": "perception_encoder", "width": 1536, "layers": 47, "heads": 16, "image_size": 728,
           "patch_size": 14, "mlp_ratio": 8960 / 1536, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
           "use_cls_token": False, "use_ln_pre": True, "use_ln_post": False, "use_abs_posemb": True,
           "use_rope2d": True, "ls_init_value": 0.1}
    v = Step37VisionConfig.from_hf(hub)
    assert (v.hidden_size, v.num_layers, v.num_heads, v.intermediate_size, v.features(728), v.features(504)) == \
        (1536, 47, 16, 8960, 169, 81)
    assert Step37VisionConfig.from_hf(v.to_hf()) == v
    with pytest.raises(ValueError, match="use_cls_token=True selects a vision tower"):
        Step37VisionConfig.from_hf({**hub, "use_cls_token": True})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['frobnicate'\]"):
        Step37VisionConfig.from_hf({**hub, "frobnicate": 1})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_activation_bytes_match_what_autograd_keeps(dtype):
    """The planner's vision bytes (core.costs.activations.vision_view_bytes of the config's shape)
    within 25% of core.costs.saved_bytes.SavedTensorBytes, per recompute
    mode (the bar core/costs/activations.py's formulas are held to; the CPU's LayerNorm keeps its
    statistics in bf16, GPUs in fp32)."""
    from core.costs.saved_bytes import SavedTensorBytes
    from core.transformer.block import apply_recompute
    from core.costs.activations import vision_view_bytes
    from models.step37.costs import vision_shape

    cfg = Step37Config.preset("step37-tiny-vlm")
    model = Step37Model(cfg).to(dtype)
    for granularity in ("none", "selective", "full"):
        apply_recompute(model, granularity)
        for side in (GLOBAL, CROP):
            with SavedTensorBytes(model) as saved:
                model.multi_modal_projector(model.vision_model([torch.randn(1, 3, side, side)])[0])
            predicted = vision_view_bytes(vision_shape(cfg), side, dtype.itemsize, granularity)
            assert 0.8 <= predicted / saved.bytes <= 1.25, (granularity, side, predicted, saved.bytes)


def test_vision_rope_angles_reach_the_rotation_in_fp32_under_fsdp_bf16(monkeypatch):
    """FSDP2's bf16 mixed precision casts a unit's floating forward inputs to bf16; the vision
    tower's cos / sin travel in ``Angles``, which it leaves alone, so q and k rotate with fp32
    angles as transformers' do (a plain tuple arrives in bf16: the check can fail)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import core.transformer.vit as vit
    from core.transformer.axial_rotary import AxialRotaryEmbedding, grid_coordinates

    seen = []
    rotate = vit.apply_pair_rotary
    monkeypatch.setattr(vit, "apply_pair_rotary", lambda x, cos, sin, **kw: (seen.append(cos.dtype), rotate(x, cos, sin, **kw))[1])
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layer = vit.ViTLayer(16, 2, 32)
        fully_shard(layer, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"),
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        angles = AxialRotaryEmbedding(8, 1e4)(grid_coordinates(2, 2), torch.float32)
        layer(torch.randn(1, 4, 16, dtype=torch.bfloat16), angles)
        assert seen == [torch.float32, torch.float32]
        seen.clear()
        layer(torch.randn(1, 4, 16, dtype=torch.bfloat16), tuple(angles))
        assert seen == [torch.bfloat16, torch.bfloat16]  # what a tuple would have given
    finally:
        if own:
            dist.destroy_process_group()

"""The planner with images (training/planner/vision.py): the vision tower's FLOPs per view
against a hand count and against torch's own FLOP counter on the same operations; stage 0's
forward grows by exactly F x T / f x V; the default layout moves decoder layers off stage 0;
the tower's weights are booked on stage 0 only; the VLM recipe is the image search's top row."""
from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from core.costs.activations import vision_view_bytes
from core.costs.flops import vision_params, vision_view_flops
from core.costs.shapes import VisionShape
from models.registry import shapes_of
from models.step37 import Step37Config
from models.step37.costs import vision_shape
from tests.planner_inputs import inputs
from training.planner.inputs import optim_options
from training.planner.memory import plan
from training.planner.vision import layout_for, vision_bytes, vision_flops

# hidden 8, MLP 16, 2 blocks of 2 heads, patches of 2 pixels: a global view of 8 x 8 pixels is a
# 4 x 4 grid (16 patches), one downsampler (3 x 3, stride 2, pad 1) to 2 x 2 = 4 features of 16
# channels, projected to 12; a crop of 4 pixels is 2 x 2 patches -> 1 x 1 = 1 feature
TINY_V = VisionShape(hidden=8, intermediate=16, depth=2, heads=2, patch=2, image_size=8, crop_size=4, channels=3,
                     positions=16, downsamplers=((16, 3, 2, 1),), out_hidden=12)
TINY = Step37Config.preset("tiny")
FLASH = Step37Config.preset("step37-flash")


def test_view_flops_hand_worked():
    """Patch embedding 2 x 16 patches x (3 x 2 x 2) x 8 = 3,072; a block 2 x 16 x (4 x 8^2 +
    2 x 8 x 16) + 4 x 8 x 16^2 = 24,576 (two: 49,152); the downsampler's 4 outputs x (8 x 3 x 3)
    x 16 x 2 = 9,216; the projector 4 x 16 x 12 x 2 = 1,536."""
    f = vision_view_flops(TINY_V, 8)
    assert f == {"embedding": 3072, "layers": 49152, "downsamplers": 9216, "projector": 1536}
    assert (TINY_V.patches(8), TINY_V.features(8), TINY_V.features(4)) == (16, 4, 1)


def _reference_view(v: VisionShape, size: int) -> None:
    """One view through the same operations as a ViT in plain torch (random weights): what the
    FLOP counter counts of it is what the model should."""
    H, n, g = v.hidden, v.patches(size), v.grid(size)
    x = F.conv2d(torch.randn(1, v.channels, size, size), torch.randn(H, v.channels, v.patch, v.patch), stride=v.patch)
    h = x.flatten(2).transpose(1, 2)                            # [1, n, H]
    d = H // v.heads
    for _ in range(v.depth):
        q, k, val = (F.linear(h, torch.randn(H, H)).view(1, n, v.heads, d).transpose(1, 2) for _ in range(3))
        a = ((q @ k.transpose(-2, -1)).softmax(-1) @ val).transpose(1, 2).reshape(1, n, H)  # every patch
        h = h + F.linear(a, torch.randn(H, H))
        h = h + F.linear(F.linear(h, torch.randn(v.intermediate, H)), torch.randn(H, v.intermediate))
    y, c = h.transpose(1, 2).reshape(1, H, g, g), H
    for o, ks, s, p in v.downsamplers:
        y, c = F.conv2d(y, torch.randn(o, c, ks, ks), stride=s, padding=p), o
    F.linear(y.flatten(2).transpose(1, 2), torch.randn(v.out_hidden, c))


@pytest.mark.parametrize("size", [8, 4])
def test_view_flops_equal_torchs_flop_counter(size):
    """torch.utils.flop_counter counts matmuls and convolutions (padding included; attention as
    its two matmuls, 4 n^2 d per head) exactly as the model does: equal, no tolerance."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        _reference_view(TINY_V, size)
    assert counter.get_total_flops() == sum(vision_view_flops(TINY_V, size).values())


def test_published_tower_shapes_and_parameters():
    """The published tower: 728 -> 52 x 52 patches -> 26 -> 13: 169 features; crops 504 -> 36 ->
    18 -> 9: 81; one image feature costs 16 patches of 47 blocks (68.8 GFLOP forward at 728,
    2.3 text tokens' worth of the whole decoder). Parameters as transformers'
    ``Step3p7VisionModel`` counts them (113,216 for hidden 32, mlp_ratio 2, 2 layers, 2 heads,
    patch 4, image 32, counted once from the module) plus the 4H -> text hidden projector."""
    v = shapes_of(FLASH).vision
    assert (v.hidden, v.intermediate, v.depth, v.heads, v.features(728), v.features(504)) == (1536, 8960, 47, 16, 169, 81)
    per_feature = sum(vision_view_flops(v, 728).values()) / 169
    assert 68.8e9 < per_feature < 68.9e9
    small = vision_shape(SimpleNamespace(vision_config={"hidden_size": 32, "mlp_ratio": 2.0, "num_hidden_layers": 2,
                                                        "num_attention_heads": 2, "patch_size": 4, "image_size": 32},
                                         hidden_size=64))
    assert small.intermediate == 64 and vision_params(small) == 113216 + 4 * 32 * 64


def test_stage0_forward_grows_by_share_x_tokens_over_features_x_view_flops():
    """PP2 with a fixed layout: stage 0's forward compute grows by F x T / f x V (F = 0.25, T =
    1,024 tokens, f = 169 + 2 x 81 features per image, V = the global view's FLOPs plus two
    crops'); the backward by twice that plus the blocks' rerun (full recompute); stage 1 not at
    all. Text only (F = 0) is the plan without images."""
    from training.planner.memory import placement
    from training.planner.timing import TimeAssumptions, rank_work
    from training.planner.vision import planned_shares

    base = inputs(pp=2, seq_length=1024, num_microbatches=2, optimizer="adamw", pipeline_layout="2,2",
                  recompute_granularity="full", bf16=True)
    img = replace(base, image_token_share=0.25, image_crops_per_image=2)
    v, a, peak = shapes_of(TINY).vision, TimeAssumptions(), 989.5
    eff = a.assumed_mfu * peak * 1e12
    V = {size: vision_view_flops(v, size) for size in (728, 504)}
    view = sum(V[728].values()) + 2 * sum(V[504].values())
    grow = 0.25 * 1024 / (169 + 2 * 81) * view
    blocks = 0.25 * 1024 / (169 + 2 * 81) * (V[728]["layers"] + 2 * V[504]["layers"])

    def passes(inp, rank):
        return rank_work(TINY, planned_shares(TINY, inp)[rank], inp, a, placement(inp), peak, rank)[0][0]

    (f0, b0), (f1, b1) = passes(base, 0), passes(img, 0)
    assert f1.seconds["compute"] - f0.seconds["compute"] == pytest.approx(grow / eff, rel=1e-12)
    assert b1.seconds["compute"] - b0.seconds["compute"] == pytest.approx((2 * grow + blocks) / eff, rel=1e-12)
    (f0, b0), (f1, b1) = passes(base, 1), passes(img, 1)
    assert (f0.seconds, b0.seconds) == (f1.seconds, b1.seconds)
    assert vision_flops(TINY, base).useful == 0 and vision_bytes(TINY, base) == 0


def test_under_cp_every_rank_encodes_the_whole_packs_images():
    """Every CP rank encodes all its pack's images (data/cp_shard.py): at CP2 a stage-0 rank's
    encoder compute and activations are the whole pack's, the same as at CP1, while its decoder
    work halves."""
    from training.planner.memory import placement
    from training.planner.timing import TimeAssumptions, rank_work
    from training.planner.vision import planned_shares

    a, peak = TimeAssumptions(), 989.5
    one = inputs(seq_length=1024, num_microbatches=2, optimizer="adamw", bf16=True)
    two = replace(one, cp=2, dp=1)

    def encoder_seconds(inp):
        f, b = (rank_work(TINY, planned_shares(TINY, x)[0], x, a, placement(x), peak, 0)[0][0]
                for x in (replace(inp, image_token_share=0.25), inp))
        return f[0].seconds["compute"] - b[0].seconds["compute"]

    assert vision_bytes(TINY, replace(two, image_token_share=0.25)) == \
        vision_bytes(TINY, replace(one, image_token_share=0.25)) > 0
    assert encoder_seconds(two) == pytest.approx(encoder_seconds(one), rel=1e-12) and encoder_seconds(one) > 0


def test_frozen_tower_runs_its_forward_only():
    inp = inputs(seq_length=1024, image_token_share=0.5)
    trained, frozen = vision_flops(TINY, inp), vision_flops(TINY, replace(inp, freeze_vision=True))
    lora = vision_flops(TINY, replace(inp, lora_rank=4, optim=optim_options("adamw")))
    v = shapes_of(TINY).vision
    assert trained.forward == frozen.forward == lora.forward and trained.backward == 2 * trained.forward
    assert frozen.backward == pytest.approx(0.5 * 1024 / 169 * vision_view_flops(v, 728)["projector"] / 1024)
    assert lora.backward == 0 and lora.redo == 0


def test_balance_moves_layers_off_stage_0_with_images():
    """Step-3.7-Flash on 4 stages at 8K: text only, the trainer's default (None); a quarter of the
    tokens images (an image token's tower costs 2.3 decoder passes), stage 0 keeps fewer layers."""
    from core.costs.flops import balanced_layout

    text = inputs(pp=4, seq_length=8192, bf16=True)
    assert layout_for(FLASH, text) is None
    default = balanced_layout(shapes_of(FLASH), 4, 8192)
    counts = [int(x) for x in layout_for(FLASH, replace(text, image_token_share=0.25)).split(",")]
    assert sum(counts) == 45 and counts[0] < default[0] and all(c >= d for c, d in zip(counts[1:], default[1:]))
    assert layout_for(FLASH, replace(text, image_token_share=0.25, pipeline_layout="12,11,11,11")) == "12,11,11,11"


def test_memory_books_the_tower_on_stage_0_only():
    """Stage 0 holds the tower's parameters (fp32, gradients fp32, AdamW's two moments and a step
    per tensor) and its activations; stage 1's plan is unchanged."""
    base = inputs(pp=2, seq_length=1024, num_microbatches=2, optimizer="adamw", pipeline_layout="2,2")
    img = replace(base, image_token_share=0.25)
    v = shapes_of(TINY).vision
    P, tensors = vision_params(v), len(v.parameters())
    (t0, t1), (i0, i1) = plan(TINY, base), plan(TINY, img)
    assert i0.parameters - t0.parameters == P
    assert i0.device["parameters"] - t0.device["parameters"] == 4 * P
    assert i0.device["gradients"] - t0.device["gradients"] == 4 * P
    assert i0.device["optimizer"] - t0.device["optimizer"] == 8 * P + 4 * tensors
    in_flight = 2  # PP2, 2 micro-batches: stage 0 holds both before its first backward
    assert i0.device["activations"] - t0.device["activations"] == in_flight * vision_bytes(TINY, img)
    assert vision_bytes(TINY, img) == round(0.25 * 1024 / 169 * vision_view_bytes(v, 728, 4))
    assert (i1.parameters, i1.device) == (t1.parameters, t1.device)
    frozen = plan(TINY, replace(img, freeze_vision=True))[0]
    proj = math.prod((v.out_hidden, v.feature_dim))
    assert frozen.device["gradients"] - t0.device["gradients"] == 4 * proj


def test_recipe_runs_the_image_search_top_row(tmp_path):
    """examples/step37_flash_8xh200_vlm_sft.sh: its layout flags are the search's fastest fitting
    layout for Step-3.7-Flash on 8 x H200 at 8K, 32 packs, a quarter of the tokens image
    features from images of about 1024 x 1024 (4 crops each), 10 GB to spare."""
    import os
    from train_args import build_parser, sections
    from training.planner.run import plan_inputs
    from training.planner.search import search
    from training.planner.vision import ImageMix
    from tests.unit.test_plan_cli import ROOT, recipe_flags
    import json

    hf = tmp_path / "flash"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(Step37Config.preset("step37-flash-vlm").to_hf()))
    script = os.path.join(ROOT, "examples", "step37_flash_8xh200_vlm_sft.sh")
    text = open(script).read()
    assert "--image-token-share 0.25 --image-crops-per-image 4" in text
    flags = recipe_flags(str(hf), script)
    parser = build_parser(require_data=False)
    args = sections(parser.parse_args(flags), parser)
    args.images = ImageMix(image_token_share=0.25, image_crops_per_image=4)
    top = search(Step37Config.from_hf(str(hf)), 8, plan_inputs(args), args.data.global_batch_size,
                 progress=False, host_gb=2000)[0]
    assert top.fits and top.device_gb <= 141 - 10
    wanted = top.flags().split()
    pairs = dict(zip(wanted[::2], wanted[1::2]))
    assert all(f in flags for f in wanted if f.startswith("--")), (wanted, flags)
    assert all(flags[flags.index(k) + 1] == val for k, val in pairs.items() if not val.startswith("--")), (pairs, flags)


def test_planner_flags(capsys):
    """tools/plan_memory.py: a share out of [0, 1) is a usage error naming the flag; with images
    on a pipeline the plan says which --pipeline-layout it planned (the trainer's default split
    counts text only)."""
    from tools.plan_memory import main

    assert main(["--world-size", "2", "--image-token-share", "1.5"]) == 2
    assert "--image-token-share must be in [0, 1), got 1.5" in capsys.readouterr().err
    flags = ["--world-size", "2", "--model-preset", "tiny", "--pipeline-model-parallel-size", "2", "--seq-length", "256"]
    assert main(flags + ["--image-token-share", "0.25"]) == 0
    assert "planned with --pipeline-layout 1,3" in capsys.readouterr().out
    assert main(flags) == 0
    assert "--pipeline-layout" not in capsys.readouterr().out


def test_vit_block_keeps_what_the_planner_books():
    """A pre-norm ViT block in plain torch (LayerNorms, q / k / v / o and fc1 / fc2 with biases,
    2-D-style rotary on q and k, the fused CPU attention kernel, quick-GELU, layer scales), fp32,
    one view of 64 patches: autograd's saved bytes (``core.costs.saved_bytes.SavedTensorBytes``) within 25%
    of ``vit_layer_bytes`` (the bound the decoder's formula is held to); under full recompute the
    block's input only."""
    from core.costs.activations import vit_layer_bytes
    from core.costs.saved_bytes import SavedTensorBytes

    torch.manual_seed(0)
    H, I, heads, n = 32, 64, 2, 64
    v = VisionShape(hidden=H, intermediate=I, depth=1, heads=heads, patch=2, image_size=16)
    d = H // heads
    mods = torch.nn.ModuleDict({"ln1": torch.nn.LayerNorm(H), "ln2": torch.nn.LayerNorm(H),
                                **{k: torch.nn.Linear(H, H) for k in "qkvo"},
                                "fc1": torch.nn.Linear(H, I), "fc2": torch.nn.Linear(I, H)})
    scale1, scale2 = torch.nn.Parameter(torch.full((H,), 0.1)), torch.nn.Parameter(torch.full((H,), 0.1))
    cos, sin = torch.randn(n, d), torch.randn(n, d)

    def rope(t):
        half = torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1)
        return t * cos + half * sin

    x = torch.randn(1, n, H, requires_grad=True)
    with SavedTensorBytes(mods) as saved:
        h = mods["ln1"](x)
        q, k, val = (mods[c](h).view(1, n, heads, d).transpose(1, 2) for c in "qkv")
        a = F.scaled_dot_product_attention(rope(q), rope(k), val).transpose(1, 2).reshape(1, n, H)
        y = x + scale1 * mods["o"](a)
        g = mods["fc1"](mods["ln2"](y))
        out = y + scale2 * mods["fc2"](g * torch.sigmoid(1.702 * g))
    out.sum().backward()
    assert 0.75 <= vit_layer_bytes(v, n, 4) / saved.bytes <= 1.25, (vit_layer_bytes(v, n, 4), saved.bytes)
    assert vit_layer_bytes(v, n, 4, "full") == n * H * 4


def test_mfu_counts_the_encoders_forward_and_backward_and_rows_print_the_layout():
    """MFU's useful FLOPs grow by the encoder's forward and backward (no recompute) per token of
    every pack; a searched row with images on a pipeline prints the layout it was planned with."""
    from training.planner.search import evaluate
    from training.planner.timing import TimeAssumptions, plan_time

    base = inputs(seq_length=512, num_microbatches=2, optimizer="adamw", recompute_granularity="full")
    img = replace(base, image_token_share=0.25)
    useful = lambda inp: (lambda st: st.mfu * st.step_s * inp.sizes.world * st.peak_tflops * 1e12)(plan_time(TINY, inp))
    assert useful(img) - useful(base) == pytest.approx(vision_flops(TINY, img).useful * 512 * 2, rel=1e-9)
    a = TimeAssumptions()
    piped = replace(img, pp=2)
    assert evaluate(TINY, piped, a, 989.5, 2, 0.0).flags().endswith("--pipeline-layout 1,3")
    assert "--pipeline-layout" not in evaluate(TINY, replace(base, pp=2), a, 989.5, 2, 0.0).flags()


def test_a_vlm_config_books_the_tower_its_model_holds_once():
    """For a config whose model builds the tower (step37-tiny-vlm), the planner's stage-0
    parameter count is the built model's, with or without images in the plan: the shares leave
    the chunk's own tower out and the planner books it from its shape, once."""
    from models.step37 import Step37Model

    cfg = Step37Config.preset("step37-tiny-vlm")
    with torch.device("meta"):
        whole = sum(p.numel() for p in Step37Model(cfg).parameters())
    for share in (0.0, 0.25):
        (r,) = plan(cfg, inputs(seq_length=256, num_microbatches=1, optimizer="adamw", image_token_share=share))
        assert r.parameters == whole, (share, r.parameters, whole)

"""Step-3.7's blocks as shapes (``core/shapes.py``): what the FLOP model, the activation-byte
model and the planner read of it. Attention is gated GQA with partial rotary on full layers;
dense layers clamp with the shared-expert limits; MoE layers have a shared expert; each MTP depth
is a decoder layer with an ``eh_proj`` input projection (2 x hidden) and its own head."""
from __future__ import annotations

from core.transformer.rotary import rotary_dim
from core.shapes import AttentionShape, BlockShape, FFNShape, ModelShapes
from models.step37.config import Step37Config


def _block(cfg: Step37Config, layer_type: str, mlp_type: str, limit, shared_limit, **extra) -> BlockShape:
    window = cfg.sliding_window if layer_type == "sliding_attention" else None
    attn = AttentionShape(cfg.num_heads(layer_type), cfg.num_key_value_heads, cfg.head_dim, window, gate=True,
                          rotary_dim=rotary_dim(cfg.head_dim, cfg.rope_parameters[layer_type]))
    if mlp_type == "dense":
        ffn = FFNShape("dense", cfg.intermediate_size, clamped=shared_limit is not None)
    else:
        ffn = FFNShape("moe", cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                       cfg.shared_expert_size, clamped=limit is not None, shared_clamped=shared_limit is not None)
    return BlockShape(attn, ffn, **extra)


def model_shapes(cfg: Step37Config) -> ModelShapes:
    blocks = tuple(_block(cfg, cfg.layer_types[i], cfg.mlp_layer_types[i], cfg.swiglu_limits[i],
                          cfg.swiglu_limits_shared[i]) for i in range(cfg.num_layers))
    extra = tuple(_block(cfg, cfg.mtp_layer_types[k], cfg.mtp_mlp_layer_types[k], cfg.mtp_swiglu_limits[k],
                         cfg.mtp_swiglu_limits_shared[k], input_proj=2 * cfg.hidden_size, head=True)
                  for k in range(cfg.num_mtp_layers))
    return ModelShapes(cfg.hidden_size, cfg.vocab_size, blocks, extra)


def vision_view_flops(cfg: Step37Config, side: int) -> int:
    """Forward FLOPs (2 per multiply-add) of one square view of ``side`` pixels through the
    vision tower, its downsamplers and the projector (``models/step37/vision.py``): the patch
    convolution, per layer the qkv / output / MLP GEMMs and the attention's two products over
    the view's patches, then the two 3 x 3 stride-2 convolutions and the projector. Norms,
    RoPE and activations are left out, as in the text FLOP model."""
    v = cfg.vision
    D, grid = v.hidden_size, side // v.patch_size
    n = grid * grid
    g1 = (grid + 1) // 2
    g2 = (g1 + 1) // 2
    flops = 2 * n * v.num_channels * v.patch_size ** 2 * D
    per_layer = 2 * n * D * 3 * D + 2 * n * D * D + 2 * 2 * n * n * D + 2 * 2 * n * D * v.intermediate_size
    flops += v.num_layers * per_layer
    flops += 2 * g1 * g1 * 9 * D * 2 * D + 2 * g2 * g2 * 9 * 2 * D * 4 * D
    return flops + 2 * g2 * g2 * 4 * D * cfg.hidden_size


def vision_view_activation_bytes(cfg: Step37Config, side: int, b: int, recompute: str = "none") -> int:
    """Bytes autograd keeps for backward for one square view of ``side`` pixels through the
    tower, downsamplers and projector, activations of ``b`` bytes (what core's ViT layer and
    ``models/step37/vision.py`` save; the unit tests hold it within 25% of a measurement).
    ``recompute``: ``full`` keeps each layer's input, ``selective`` drops the attention's and
    the MLP's internals (``core.transformer.vit.ViTLayer.recompute``)."""
    v = cfg.vision
    D, I, heads, grid = v.hidden_size, v.intermediate_size, v.num_heads, side // v.patch_size
    n = grid * grid
    g1 = (grid + 1) // 2
    g2 = (g1 + 1) // 2
    act, stats = n * D * b, 2 * n * 4  # one [n, D] activation; a LayerNorm's mean and rstd (fp32 on GPUs)
    if recompute == "full":
        layer = act
    elif recompute == "selective":
        # norm inputs and outputs, the two branch outputs the layer scales read
        layer = 6 * act + 2 * stats
    else:
        rot = 2 * n * D * b + (2 * n * D * 4 if b < 4 else 0)  # rotated q, k (+ their fp32 inputs)
        # residual in, norm1 out, qkv out (v is a view of it), q and k rotated, attention out +
        # logsumexp, its reshaped copy, proj out, norm2 in / out, fc1 out, sigmoid out,
        # activation out, fc2 out
        layer = 2 * act + 3 * act + rot + act + 4 * n * heads + act + act + 2 * act + 3 * n * I * b + act
        layer += 2 * stats
    pixels = v.num_channels * side * side * b  # what the patch convolution keeps (cast to its dtype)
    top = pixels + act + stats                 # pre-norm input and its statistics
    top += act + g1 * g1 * 2 * D * b + g2 * g2 * 4 * D * b  # the downsamplers' and projector's inputs
    return top + v.num_layers * layer

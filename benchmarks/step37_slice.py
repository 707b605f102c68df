"""A slice of a Step-3.7 decoder built twice, as our layers and as transformers' Step3p7 decoder
layers, with the same weights, on one packed THD batch; and the check that both compute the
same thing. Used by ``benchmarks/bench_gpu.py`` (see there for what is timed).

Weights are matched by ``models/step37/hf_weights.candidates`` (the names transformers has in
memory), never by a second table here; layers are built on ``meta`` and allocated on the device
in the compute dtype, so a full-width slice is never materialised on the host.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch import nn

# fp32 on both sides, the same terms summed in other orders (our blocked SDPA vs a masked row,
# grouped GEMM vs a per-expert loop): measured <= 2.5e-6 of the largest value on CPU over 10
# seeds (outputs, input and parameter gradients); 1e-4 leaves 40x for another device's kernels.
CHECK_REL = 1e-4
CHECK_SEQ = 256


def slice_config(cfg, backend: str = "auto"):
    """``cfg`` cut to its first sliding-attention MoE layer and first full-attention MoE layer
    (in model order), no MTP; the global indices they had."""
    idx = sorted(next(i for i in range(cfg.num_layers) if cfg.mlp_layer_types[i] == "sparse"
                      and cfg.layer_types[i] == t) for t in ("sliding_attention", "full_attention"))
    pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
    return dataclasses.replace(
        cfg, num_layers=2, layer_types=pick(cfg.layer_types), mlp_layer_types=pick(cfg.mlp_layer_types),
        swiglu_limits=pick(cfg.swiglu_limits), swiglu_limits_shared=pick(cfg.swiglu_limits_shared),
        num_mtp_layers=0, mtp_layer_types=[], mtp_mlp_layer_types=[], mtp_swiglu_limits=[],
        mtp_swiglu_limits_shared=[], attention_backend=backend), idx


def slice_flops(cfg, doc_lengths) -> float:
    """Training FLOPs of the slice's layers on these documents (no head: vocab 0 zeroes it)."""
    from models.step37.costs import training_flops

    return training_flops(dataclasses.replace(cfg, vocab_size=0), list(doc_lengths))


class _Tokens:
    """Token ids of every document: zeros (the slice never reads them) or seeded random ids."""

    def __init__(self, vocab: int = 0, seed: int = 0):
        self.vocab, self.seed = vocab, seed

    def get(self, doc, start=0, length=0):
        if not self.vocab:
            return np.zeros(length, dtype=np.int64)
        return np.random.default_rng((self.seed, doc)).integers(0, self.vocab, length, dtype=np.int64)


def packed_batch(seq_length: int, seed: int = 0, most_documents: bool = False, vocab: int = 0, packs: int = 1):
    """One THD pack of ``seq_length`` that our planner makes of log-normal documents (16 packs'
    worth): the plan's first pack (its order is a seeded shuffle: what a loader would take), or
    the one with the most documents (the check: as many boundaries as possible); or the first
    ``packs`` packs as one micro-batch. A pack's few unfilled slots are padding, folded into its
    last document as in training. Tokens are zeros, or random ids below ``vocab`` (with
    next-token labels inside each document)."""
    from data.packing import plan_packs
    from data.thd import build_thd_batch

    rng = np.random.default_rng(seed)
    median = min(300.0, seq_length / 8)
    lengths = []
    while sum(lengths) < max(16, 2 * packs) * seq_length:
        lengths.append(int(np.clip(round(rng.lognormal(math.log(median), 1.0)), 1, seq_length)))
    plan = plan_packs(np.array(lengths), seq_length, seed=seed)
    first = int(np.argmax(np.diff(plan.pack_offsets))) if most_documents else 0
    segs = [np.asarray(plan.pack(p)) for p in range(first, first + packs)]
    batch = build_thd_batch(segs, _Tokens(vocab, seed), seq_length, pad_id=0)
    return batch, [int(n) for s in segs for n in s[:, 2]]


class OursSlice(nn.Module):
    """Our decoder layers and what ``Step37Model._trunk`` builds for them from a THD batch."""

    def __init__(self, cfg):
        super().__init__()
        from core.transformer.rotary import RotaryEmbedding
        from models.step37.model import DecoderLayer

        with torch.device("meta"):
            self.layers = nn.ModuleDict({str(i): DecoderLayer(
                cfg, cfg.layer_types[i], cfg.mlp_layer_types[i], cfg.swiglu_limits[i],
                cfg.swiglu_limits_shared[i]) for i in range(cfg.num_layers)})
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(cfg.head_dim, cfg.rope_parameters[t])
                                     for t in sorted(set(cfg.layer_types))})

    def forward(self, x_TH, batch):
        from core.transformer.attention_backends import DocLayout

        layout = DocLayout.from_params(batch.packed_seq_params)
        valid = layout.valid_mask(x_TH.device)
        ropes = {t: rope(batch.position_ids, x_TH.dtype) for t, rope in self.rotary.items()}
        for layer in self.layers.values():
            x_TH, _ = layer(x_TH, ropes, layout, valid)
        return x_TH


class HFSlice(nn.Module):
    """transformers' decoder layers and what ``Step3p7TextModel.forward`` builds for them."""

    def __init__(self, cfg, device):
        super().__init__()
        from transformers import Step3p7TextConfig
        from transformers.models.step3p7.modeling_step3p7 import Step3p7DecoderLayer, Step3p7RotaryEmbedding

        self.config = Step3p7TextConfig(**cfg.to_hf())
        self.config._attn_implementation = "sdpa"
        with torch.device("meta"):
            self.layers = nn.ModuleList(Step3p7DecoderLayer(self.config, i) for i in range(cfg.num_layers))
        self.rotary_emb = Step3p7RotaryEmbedding(self.config, device=device)

    def forward(self, x_TH, batch):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        x, pos = x_TH[None], batch.position_ids[None]
        kw = dict(config=self.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
        masks = {"full_attention": create_causal_mask(**kw),
                 "sliding_attention": create_sliding_window_causal_mask(**kw)}
        ropes = {t: self.rotary_emb(x, pos, t) for t in set(self.config.layer_types)}
        for layer in self.layers:
            t = layer.attention_type
            x = layer(x, attention_mask=masks[t], position_embeddings=ropes[t], position_ids=pos)
        return x[0]


def materialise(module: nn.Module, layers: nn.Module, routers: list, device, dtype) -> None:
    """Allocate the meta-built layers on ``device`` once, in ``dtype``; ``routers`` in fp32.
    Values are left undefined: ``init_weights`` or ``copy_weights`` sets every tensor."""
    # Parameters take the dtype on meta (nothing allocated). Not ``layers.to(dtype)`` there:
    # core/precision.py would then restore its fp32 buffers from meta tensors, which have no data.
    for p in layers.parameters():
        p.data = p.data.to(dtype)
    layers.to_empty(device=device)
    layers.to(dtype)  # the buffers: transformers' router bias; ours stay fp32 (core/precision.py)
    for r in routers:
        r.float()
    module.to(device)


def build_ours(cfg, device, dtype) -> OursSlice:
    ours = OursSlice(cfg)
    routers = [layer.moe.router for layer in ours.layers.values()] if cfg.need_fp32_gate else []
    materialise(ours, ours.layers, routers, device, dtype)
    return ours


def build_hf(cfg, device, dtype) -> HFSlice:
    hf = HFSlice(cfg, device)
    routers = [layer.mlp.gate for layer in hf.layers] if cfg.need_fp32_gate else []
    materialise(hf, hf.layers, routers, device, dtype)
    return hf


@torch.no_grad()
def init_weights(ours: nn.Module, seed: int, std: float, norm_std: float = 0.0, bias_std: float = 0.0) -> None:
    """N(0, std) matrices; norms and the router bias N(0, norm_std / bias_std) (0: zeros), of
    an ``OursSlice``'s layers or of any module's tensors but the rotary tables. Drawn on the
    device, so a full-width slice never exists on the host."""
    src = ours.layers if isinstance(ours, OursSlice) else ours
    tensors = [(n, t) for n, t in list(src.named_parameters()) + list(src.named_buffers())
               if t.is_floating_point() and "rotary" not in n]
    g = torch.Generator(tensors[0][1].device).manual_seed(seed)
    for name, t in tensors:
        s = norm_std if "norm" in name else bias_std if "e_score_correction_bias" in name else std
        if s:
            t.normal_(0.0, s, generator=g)
        else:
            t.zero_()


def _half(t: torch.Tensor, half: str | None) -> torch.Tensor:
    """transformers fuses gate and up experts as [E, 2I, H]: gate is the first half of dim 1."""
    if half is None:
        return t
    mid = t.shape[1] // 2
    return t[:, :mid] if half == "gate" else t[:, mid:]


def weight_pairs(ours: OursSlice, hf: HFSlice) -> list:
    """``(our name, our tensor, transformers' tensor, half)`` for every tensor of the layers,
    matched through ``models/step37/hf_weights.candidates`` (which also knows transformers'
    in-memory names); ``half`` says which half of a fused gate/up tensor is ours."""
    theirs = dict(hf.layers.named_parameters(prefix="layers")) | dict(hf.layers.named_buffers(prefix="layers"))
    mine = list(ours.layers.named_parameters(prefix="layers")) + list(ours.layers.named_buffers(prefix="layers"))
    return match_tensors(mine, theirs, len(ours.layers))


def match_tensors(mine: list, theirs: dict, num_layers: int) -> list:
    """``weight_pairs`` over named tensors: every one of ours and of theirs must be matched."""
    from models.step37.hf_weights import candidates

    pairs, used = [], set()
    for name, t in mine:
        match = next(((c, h) for c, h in candidates(name, num_layers) if c in theirs), None)
        if match is None:
            raise KeyError(f"bench_gpu: transformers' layers have no tensor for our {name}")
        pairs.append((name, t, theirs[match[0]], match[1]))
        used.add(match[0])
    if set(theirs) - used:
        raise KeyError(f"bench_gpu: transformers' tensors nobody sets: {sorted(set(theirs) - used)}")
    return pairs


@torch.no_grad()
def copy_weights(pairs: list) -> None:
    for _, ours_t, hf_t, half in pairs:
        _half(hf_t, half).copy_(ours_t)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error against the scale of the values compared."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def check_equivalence(device, seed: int = 0) -> dict:
    """The tiny preset's slice in fp32 on ``device``: ours (sdpa) against transformers."""
    from models.step37.config import Step37Config

    cfg, idx = slice_config(Step37Config.preset("tiny"), backend="sdpa")
    batch, lengths = packed_batch(CHECK_SEQ, seed, most_documents=True)
    batch = batch.to(device)
    ours = build_ours(cfg, device, torch.float32)
    init_weights(ours, seed, std=0.3, norm_std=0.2, bias_std=0.5)  # zero norms and bias hide bugs
    hf = build_hf(cfg, device, torch.float32)
    pairs = weight_pairs(ours, hf)
    copy_weights(pairs)
    g = torch.Generator(device).manual_seed(seed + 1)
    x = torch.randn(CHECK_SEQ, cfg.hidden_size, device=device, generator=g)
    dy = torch.randn(CHECK_SEQ, cfg.hidden_size, device=device, generator=g)
    valid = torch.arange(CHECK_SEQ, device=device) < sum(lengths)
    dy = dy * valid[:, None]  # padding rows (if any) carry no gradient into either side
    results = []
    for model in (ours, hf):
        xi = x.clone().requires_grad_()
        y = model(xi, batch)
        y.backward(dy)
        results.append((y.detach()[valid], xi.grad[valid]))
    params = [(a, b, half) for _, a, b, half in pairs if a.requires_grad]  # not the router bias
    grads = max(relative_error(a.grad, _half(b.grad, half)) for a, b, half in params)
    (y_ours, dx_ours), (y_hf, dx_hf) = results
    out = {"layers": idx, "documents": len(lengths), "tokens": CHECK_SEQ, "device": str(device),
           "output": relative_error(y_ours, y_hf), "input_grad": relative_error(dx_ours, dx_hf),
           "param_grads": grads, "tensors": len(params), "tolerance": CHECK_REL}
    out["passed"] = max(out["output"], out["input_grad"], out["param_grads"]) <= CHECK_REL
    return out

"""A slice of a registered model's decoder built twice, as our layers and as transformers'
decoder layers of that family, with the same weights, on one packed THD batch; and the check that
both compute the same thing. Used by ``benchmarks/bench_gpu.py`` (see there for what is timed).

Ours is the family's own chunk (``models/registry.py``) holding just the slice's layers;
transformers' side and how the slice is cut are the family's entry in :data:`FAMILIES`. Weights
are matched by the family's weight adapter (``chunk.hf_weights.sources``: it also knows the names
transformers has in memory), never by a second table here; layers are built on ``meta`` and
allocated on the device in the compute dtype, so a full-width slice is never materialised on the
host.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch import nn

from models import registry

# fp32 on both sides, the same terms summed in other orders (our blocked SDPA vs a masked row,
# grouped GEMM vs a per-expert loop): measured <= 2.5e-6 of the largest value on CPU over 10
# seeds (outputs, input and parameter gradients); 1e-4 leaves 40x for another device's kernels.
CHECK_REL = 1e-4
CHECK_SEQ = 256


def moe_layers(cfg) -> list[int]:
    """Global indices of the MoE layers (any family: from its block shapes)."""
    return [i for i, b in enumerate(registry.shapes_of(cfg).blocks) if b.ffn.moe]


def _step37_cut(cfg, backend: str, idx: list | None = None):
    """Step-3.7: layers ``idx``, by default its first sliding-attention MoE layer and first
    full-attention MoE layer (in model order); no MTP."""
    idx = idx or sorted(next(i for i in range(cfg.num_layers) if cfg.mlp_layer_types[i] == "sparse"
                             and cfg.layer_types[i] == t) for t in ("sliding_attention", "full_attention"))
    pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
    return dataclasses.replace(
        cfg, num_layers=len(idx), layer_types=pick(cfg.layer_types), mlp_layer_types=pick(cfg.mlp_layer_types),
        swiglu_limits=pick(cfg.swiglu_limits), swiglu_limits_shared=pick(cfg.swiglu_limits_shared),
        num_mtp_layers=0, mtp_layer_types=[], mtp_mlp_layer_types=[], mtp_swiglu_limits=[],
        mtp_swiglu_limits_shared=[], attention_backend=backend), idx


def _qwen3_moe_cut(cfg, backend: str, idx: list | None = None):
    """Qwen3-MoE: MoE layers ``idx``, by default its first two (every layer attends alike)."""
    idx = idx or [i for i in range(cfg.num_layers) if cfg.is_moe(i)][:2]
    return dataclasses.replace(cfg, num_layers=len(idx), mlp_only_layers=[], decoder_sparse_step=1,
                               attention_backend=backend), idx


class HFSlice(nn.Module):
    """transformers' decoder layers of a family and what its model's ``forward`` builds for them
    (rotary tables, the causal masks its mask builders make from per-document position ids)."""

    def __init__(self, config, layers, rotary, attention_type, per_type_rope: bool):
        super().__init__()
        self.config, self.layers, self.rotary_emb = config, layers, rotary
        self.attention_type, self.per_type_rope = attention_type, per_type_rope

    def forward(self, x_TH, batch):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        x, pos = x_TH[None], batch.position_ids[None]
        kw = dict(config=self.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
        masks = {"full_attention": create_causal_mask(**kw)}
        if getattr(self.config, "sliding_window", None):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        ropes = {}
        for layer in self.layers:
            t = self.attention_type(layer)
            if t not in ropes:
                ropes[t] = self.rotary_emb(x, pos, t) if self.per_type_rope else self.rotary_emb(x, pos)
            x = layer(x, attention_mask=masks[t if t in masks else "full_attention"], position_embeddings=ropes[t],
                      position_ids=pos)
        return x[0]


def _step37_hf(cfg, device) -> HFSlice:
    from transformers import Step3p7TextConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7DecoderLayer, Step3p7RotaryEmbedding

    config = Step3p7TextConfig(**cfg.to_hf())
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        layers = nn.ModuleList(Step3p7DecoderLayer(config, i) for i in range(cfg.num_layers))
    return HFSlice(config, layers, Step3p7RotaryEmbedding(config, device=device), lambda l: l.attention_type, True)


def _qwen3_moe_hf(cfg, device) -> HFSlice:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding

    config = Qwen3MoeConfig(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        layers = nn.ModuleList(Qwen3MoeDecoderLayer(config, i) for i in range(cfg.num_layers))
    window = (lambda l: "sliding_attention") if config.sliding_window else (lambda l: "full_attention")
    return HFSlice(config, layers, Qwen3MoeRotaryEmbedding(config).to(device), window, False)


@dataclasses.dataclass(frozen=True)
class FamilySlice:
    tiny: str              # the preset --tiny and the check use
    full: str              # the full-width preset (the default)
    cut: callable          # (config, attention backend, MoE layers or None: the slice's two) ->
                           # (config of the slice, global layer indices)
    hf: callable           # (config of the slice, device) -> HFSlice
    hf_name: str           # transformers' side in the table
    hf_module: str         # the transformers module it needs (checked before anything runs)
    hf_router_fp32: bool   # transformers' router runs fp32 weights (Step3p7: need_fp32_gate casts);
                           # Qwen3Moe's multiplies in the activations' dtype (its own way, kept)


FAMILIES = {
    "step37": FamilySlice("tiny", "step37-flash", _step37_cut, _step37_hf, "transformers Step3p7",
                          "transformers.models.step3p7", True),
    "qwen3_moe": FamilySlice("qwen3-moe-tiny", "qwen3-30b-a3b", _qwen3_moe_cut, _qwen3_moe_hf,
                             "transformers Qwen3Moe", "transformers.models.qwen3_moe", False),
}


def hf_missing(fam: FamilySlice) -> str | None:
    """Why transformers' side of ``fam`` cannot run here (``None``: it can). transformers is
    optional at run time: the lent GPU's image has transformers 5.17, which has no ``step3p7``."""
    import importlib.util

    try:
        if importlib.util.find_spec(fam.hf_module) is not None:
            return None
        import transformers
        have = f"transformers {transformers.__version__} has no {fam.hf_module}"
    except ModuleNotFoundError:
        have = "transformers is not installed"
    return f"{have}: {fam.hf_name} skipped"


def family_slice(cfg) -> FamilySlice:
    family = registry.spec_of(cfg).family
    if family not in FAMILIES:
        raise ValueError(f"bench_gpu: no slice is defined for model family {family!r} "
                         f"(benchmarks/model_slice.py FAMILIES: {', '.join(FAMILIES)})")
    return FAMILIES[family]


def slice_config(cfg, backend: str = "auto", layers: list | None = None):
    """``cfg`` cut to two MoE layers of its family's slice (or to the MoE ``layers``); the
    global indices they had."""
    return family_slice(cfg).cut(cfg, backend, layers)


def slice_flops(cfg, doc_lengths) -> float:
    """Training FLOPs of the slice's layers on these documents (no head: vocab 0 zeroes it)."""
    from core.costs.flops import training_flops

    return training_flops(registry.shapes_of(dataclasses.replace(cfg, vocab_size=0)), list(doc_lengths))


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
    """The family's own chunk holding just the slice's layers (no embedding, norm or head): what
    a middle pipeline stage runs, from a THD batch."""

    def __init__(self, cfg):
        super().__init__()
        with torch.device("meta"):
            self.chunk = registry.spec_of(cfg).build(cfg, layers=range(cfg.num_layers), first=False, last=False)
        self.layers = self.chunk.layers

    def forward(self, x_TH, batch):
        return self.chunk(None, batch.position_ids, batch.packed_seq_params, hidden=x_TH)


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
    allocate_chunk(ours.chunk, device, dtype, holder=ours)
    return ours


def allocate_chunk(chunk: nn.Module, device, dtype, holder: nn.Module | None = None) -> None:
    """A meta-built chunk on ``device``: its weights in ``dtype``, routers in fp32 (where the
    family computes them so), RoPE frequencies fp32; values undefined (``init_weights``)."""
    from core.init import init_buffers
    from core.moe.router import TopKRouter

    chunk.rotary.to_empty(device=device)
    init_buffers(chunk.rotary, device)  # RoPE frequencies, fp32
    routers = [m for m in chunk.modules() if isinstance(m, TopKRouter)] if chunk.router_fp32 else []
    weights = nn.ModuleList(m for n, m in chunk.named_children() if n != "rotary")
    materialise(holder or chunk, weights, routers, device, dtype)


def build_hf(cfg, device, dtype, fp32_routers: bool = True) -> HFSlice:
    """transformers' slice; ``fp32_routers``: its routers in fp32 like ours (``router_fp32``)
    where transformers can run them so."""
    fam = family_slice(cfg)
    hf = fam.hf(cfg, device)
    keep = fp32_routers and (fam.hf_router_fp32 or dtype == torch.float32)
    routers = [m.mlp.gate for m in hf.layers if hasattr(m.mlp, "gate")] if keep else []
    materialise(hf, hf.layers, routers, device, dtype)
    return hf


@torch.no_grad()
def init_weights(ours: nn.Module, seed: int, std: float, norm_std: float = 0.0, bias_std: float = 0.0) -> None:
    """N(0, std) matrices; norms N(c, norm_std) around their own initial value c (0 for ``1 + w``,
    1 for plain ``w``); the router bias N(0, bias_std) (0: zeros). Drawn on the device, so a
    full-width slice never exists on the host. ``ours``: an ``OursSlice`` (its layers), or any
    chunk (all of its floating-point weights but the RoPE tables)."""
    from core.init import constant_values

    module = ours.layers if isinstance(ours, OursSlice) else \
        nn.ModuleDict({n: m for n, m in ours.named_children() if n != "rotary"})
    tensors = [(n, t) for n, t in list(module.named_parameters()) + list(module.named_buffers())
               if t.is_floating_point()]
    constants = constant_values(module)
    g = torch.Generator(tensors[0][1].device).manual_seed(seed)
    for name, t in tensors:
        if name in constants:
            t.normal_(constants[name], norm_std, generator=g) if norm_std else t.fill_(constants[name])
        elif s := bias_std if "e_score_correction_bias" in name else std:
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
    matched through the family's weight adapter (which also knows transformers' in-memory
    names); ``half`` says which half of a fused gate/up tensor is ours."""
    theirs = dict(hf.layers.named_parameters(prefix="layers")) | dict(hf.layers.named_buffers(prefix="layers"))
    mine = list(ours.layers.named_parameters(prefix="layers")) + list(ours.layers.named_buffers(prefix="layers"))
    return match_tensors(mine, theirs, ours.chunk.hf_weights)


def match_tensors(mine: list, theirs: dict, adapter) -> list:
    """``weight_pairs`` over named tensors through a weight ``adapter``: every one of ours and
    of theirs must be matched."""
    pairs, used = [], set()
    for name, t in mine:
        match = next(((src.name, src.half) for src in adapter.sources(name) if src.name in theirs), None)
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


def check_equivalence(device, seed: int = 0, preset: str = "tiny") -> dict:
    """A tiny preset's slice in fp32 on ``device``: ours (sdpa) against transformers."""
    cfg, idx = slice_config(registry.resolve(preset)[1], backend="sdpa")
    batch, lengths = packed_batch(CHECK_SEQ, seed, most_documents=True)
    batch = batch.to(device)
    ours = build_ours(cfg, device, torch.float32)
    init_weights(ours, seed, std=0.3, norm_std=0.2, bias_std=0.5)  # zero norms and bias hide bugs
    hf = build_hf(cfg, device, torch.float32, ours.chunk.router_fp32)
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
    out = {"preset": preset, "layers": idx, "documents": len(lengths), "tokens": CHECK_SEQ, "device": str(device),
           "output": relative_error(y_ours, y_hf), "input_grad": relative_error(dx_ours, dx_hf),
           "param_grads": grads, "tensors": len(params), "tolerance": CHECK_REL}
    out["passed"] = max(out["output"], out["input_grad"], out["param_grads"]) <= CHECK_REL
    return out

"""Step-3.7 text decoder on THD input: single-device maths only (parallelism is applied from
outside, see DESIGN.md). Layers live in a ``ModuleDict`` keyed by global index, so a pipeline
stage that owns layers ``a..b`` has the same parameter names as the whole model.

Forward: ``model(tokens, position_ids, packed_seq_params)`` -> logits ``[T, vocab]`` (or the
hidden state ``[T, hidden]`` on a stage without the head). With ``labels`` (training) it returns
core's :class:`~core.model_api.StageOutput`: the hidden state to send on, or on the last stage
sums of token cross-entropies and target counts (main head and each MTP depth separately; the
caller normalises once per step by the global token count), plus the MoE layers' auxiliary loss
and routing load. ``param_specs``, ``fsdp_units`` and ``moe_layers`` tell core the rest of what
it needs (see ``core/model_api.py``).

Multi-token prediction, depth k = 1..D (DeepSeek-V3 style): ``h_k = block_k(eh_proj([enorm(
embed(x shifted by k)), hnorm(h_{k-1})]))`` with ``h_0`` the main model's last hidden state
before the final norm, and depth k's logits at position t predict token t + k + 1. Shifts stay
inside each document: a position whose shifted input or target would come from the next
document gets padding and no target.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.model_api import FSDPUnit, ParamSpec, StageOutput
from core.moe.experts import GroupedExperts
from core.moe.layer import MoELayer
from core.moe.router import SigmoidRouter
from core.packed_seq import PackedSeqParams
from core.transformer.attention import GatedAttention
from core.transformer.attention_backends import DocLayout
from core.transformer.mlp import SwiGLUMLP
from core.transformer.norm import RMSNorm
from core.transformer.rotary import RotaryEmbedding
from models.step37.config import Step37Config
from models.step37.materialize import materialize

IGNORE_INDEX = -100


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Step37Config, layer_type: str, mlp_type: str,
                 limit: float | None, shared_limit: float | None, experts: range | None = None):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GatedAttention(
            cfg.hidden_size, cfg.num_heads(layer_type), cfg.num_key_value_heads, cfg.head_dim,
            window=cfg.sliding_window if layer_type == "sliding_attention" else None,
            softmax_scale=cfg.query_pre_attn_scalar ** -0.5, eps=cfg.rms_norm_eps,
            backend=cfg.attention_backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if mlp_type == "dense":  # Step-3.x clamps dense layers with the shared-expert limits
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, shared_limit)
        else:
            self.moe = MoELayer(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                cfg.moe_intermediate_size, cfg.shared_expert_size,
                                scaling=cfg.moe_router_scaling_factor, limit=limit,
                                shared_limit=shared_limit, experts=experts)

    recompute: str = "none"  # "full": keep only the input; "selective": drop attention and FFN internals

    def forward(self, x_TH, ropes: dict, layout: DocLayout, valid_T) -> tuple[torch.Tensor, dict | None]:
        """``(output, MoE statistics or None)``; recompute reruns the maths during backward but
        its statistics are dropped there, so each micro-batch counts once."""
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x_TH, ropes, layout, valid_T, use_reentrant=False)
        return self._forward(x_TH, ropes, layout, valid_T)

    def _forward(self, x_TH, ropes, layout, valid_T):
        h, y = self.attention_block(x_TH, ropes, layout)
        selective = self.recompute == "selective" and torch.is_grad_enabled()
        ffn = self.mlp if hasattr(self, "mlp") else self.moe
        args = (y,) if hasattr(self, "mlp") else (y, valid_T)
        y = checkpoint(ffn, *args, use_reentrant=False) if selective else ffn(*args)
        y, stats = y if isinstance(y, tuple) else (y, None)
        return h + y, stats

    def attention_block(self, x_TH, ropes, layout):
        """``(residual stream after attention, its post-attention norm)``: the part of the layer
        before the FFN (a unit of its own for ``--compile`` when the FFN communicates)."""
        selective = self.recompute == "selective" and torch.is_grad_enabled()
        h_in = self.input_layernorm(x_TH)
        attn = (checkpoint(self.self_attn, h_in, ropes[self.layer_type], layout, use_reentrant=False)
                if selective else self.self_attn(h_in, ropes[self.layer_type], layout))
        h = x_TH + attn
        return h, self.post_attention_layernorm(h)


class MTPDepth(nn.Module):
    def __init__(self, cfg: Step37Config, k: int, experts: range | None = None):
        super().__init__()
        H = cfg.hidden_size
        self.enorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = DecoderLayer(cfg, cfg.mtp_layer_types[k], cfg.mtp_mlp_layer_types[k],
                                  cfg.mtp_swiglu_limits[k], cfg.mtp_swiglu_limits_shared[k], experts)
        self.head_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.head = nn.Linear(H, cfg.vocab_size, bias=False)

    def forward(self, emb_TH, h_prev_TH, ropes, layout, valid_T):
        """(hidden state for the next depth, this depth's logits, MoE statistics or None). The
        head runs inside the forward so a wrapper that gathers this module's weights (FSDP)
        covers it."""
        x = self.eh_proj(torch.cat([self.enorm(emb_TH), self.hnorm(h_prev_TH)], dim=-1))
        h, stats = self.block(x, ropes, layout, valid_T)
        return h, self.head(self.head_norm(h)), stats


class Step37Model(nn.Module):
    """The whole decoder, or one pipeline stage of it (``layers``: the global indices it owns;
    ``first``: holds the embedding; ``last``: holds final norm, head and MTP; ``experts``: the
    global expert indices whose weights this process holds, all by default)."""

    def __init__(self, config: Step37Config, *, layers=None, first: bool = True, last: bool = True,
                 experts: range | None = None, seed: int = 0):
        super().__init__()
        cfg = self.config = config
        own = list(range(cfg.num_layers) if layers is None else layers)
        target = torch.get_default_device()  # where the tensors go: built on meta, then written once
        with torch.device("meta"):
            self._build(cfg, own, first, last, experts)
        if target.type != "meta":
            materialize(self, target, seed=seed)

    def _build(self, cfg: Step37Config, own: list, first: bool, last: bool, experts: range | None) -> None:
        self.first, self.last = first, last
        has_mtp = last and cfg.num_mtp_layers > 0
        # MTP feeds shifted token embeddings, so a last stage with MTP holds the embedding too
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if first or has_mtp else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(
            cfg, cfg.layer_types[i], cfg.mlp_layer_types[i], cfg.swiglu_limits[i],
            cfg.swiglu_limits_shared[i], experts) for i in own})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if last else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if last else None
        self.mtp = nn.ModuleDict({str(k): MTPDepth(cfg, k, experts) for k in range(cfg.num_mtp_layers)}) \
            if has_mtp else None
        types = {cfg.layer_types[i] for i in own} | (set(cfg.mtp_layer_types) if has_mtp else set())
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(cfg.head_dim, cfg.rope_parameters[t])
                                     for t in sorted(types)})

    # ------------------------------------------------------------------ what core needs
    def param_specs(self) -> dict[str, ParamSpec]:
        """Roles for core (``core/model_api.py``): embedding and heads stay on AdamW; routed
        experts are expert-parallel shards stacked on dim 0; with MTP the embedding has a copy
        on the last stage too (tied: its gradients are summed with the first stage's)."""
        embedding = ParamSpec(role="embedding", tied=self.config.num_mtp_layers > 0)
        heads = [self.lm_head] + ([d.head for d in self.mtp.values()] if self.mtp is not None else [])
        special = {id(m.weight): ParamSpec(role="head") for m in heads if m is not None}
        if self.embed_tokens is not None:
            special[id(self.embed_tokens.weight)] = embedding
        for m in self.modules():
            if isinstance(m, GroupedExperts):
                spec = ParamSpec(replicated_over="expert_dp", expert_offset=m.expert_offset)
                special.update({id(p): spec for p in m.parameters()})
        return {n: special.get(id(p), ParamSpec()) for n, p in self.named_parameters()}

    def _blocks(self) -> list[nn.Module]:
        return list(self.layers.values()) + (list(self.mtp.values()) if self.mtp is not None else [])

    def fsdp_units(self) -> list[FSDPUnit]:
        """Each decoder layer and MTP depth is a unit over DP, its routed experts an inner unit
        over expert-DP and its router an inner unit that computes in fp32 (the published
        ``need_fp32_gate``); embedding, final norm and head fall to the root (the chunk)."""
        units = []
        for block in self._blocks():
            for m in block.modules():
                if isinstance(m, GroupedExperts):
                    units.append(FSDPUnit(m, "expert_dp"))
                elif isinstance(m, SigmoidRouter) and self.config.need_fp32_gate:
                    units.append(FSDPUnit(m, "dp", fp32=True))
            units.append(FSDPUnit(block, "dp"))
        return units

    def moe_layers(self) -> list[MoELayer]:
        """MoE layers in forward order: the rows of ``StageOutput.expert_load``."""
        return [m for block in self._blocks() for m in block.modules() if isinstance(m, MoELayer)]

    # ------------------------------------------------------------------ forward
    def forward(self, tokens=None, position_ids=None, packed_seq_params: PackedSeqParams = None,
                *, hidden=None, labels=None):
        x, ropes, layout, valid, stats = self._trunk(tokens, position_ids, packed_seq_params, hidden)
        if labels is None:
            return self.lm_head(self.norm(x)) if self.last else x
        if not self.last:
            return _with_moe_stats(StageOutput(hidden=x), stats)
        loss_sum, num_tokens = _token_loss(self.lm_head(self.norm(x)), labels)
        out = StageOutput(loss_sum=loss_sum, num_tokens=num_tokens)
        if self.mtp is not None:
            self._mtp_losses(out, stats, x, tokens, labels, ropes, layout, valid)
        return _with_moe_stats(out, stats)

    def final_hidden(self, tokens, position_ids, packed_seq_params) -> torch.Tensor:
        """The normalised last hidden state ``[T, hidden]`` (what the head reads)."""
        return self.norm(self._trunk(tokens, position_ids, packed_seq_params, None)[0])

    def _trunk(self, tokens, position_ids, packed_seq_params, hidden):
        layout = DocLayout.from_params(packed_seq_params)
        valid = layout.valid_mask(position_ids.device)
        x = self.embed_tokens(tokens) if self.first else hidden
        ropes = {t: rope(position_ids, x.dtype) for t, rope in self.rotary.items()}
        stats = []
        for layer in self.layers.values():
            x, s = layer(x, ropes, layout, valid)
            stats += [s] if s is not None else []
        return x, ropes, layout, valid, stats

    def _mtp_losses(self, out: StageOutput, stats: list, h, tokens, labels, ropes, layout, valid) -> None:
        nxt, ok = _next_in_document(layout, tokens.device)
        shifted_tokens, shifted_labels = tokens, labels
        for k, depth in enumerate(self.mtp.values(), start=1):
            shifted_tokens = torch.where(ok, shifted_tokens[nxt], torch.zeros_like(tokens))
            shifted_labels = torch.where(ok, shifted_labels[nxt], torch.full_like(labels, IGNORE_INDEX))
            h, logits, s = depth(self.embed_tokens(shifted_tokens), h, ropes, layout, valid)
            stats += [s] if s is not None else []
            loss, n = _token_loss(logits, shifted_labels)
            out.mtp_loss_sums.append(loss)
            out.mtp_num_tokens.append(n)

    # ------------------------------------------------------------------ weights
    def load_hf(self, path: str, **kwargs):
        from models.step37.hf_weights import load_hf_weights

        return load_hf_weights(self, path, **kwargs)

    def save_hf(self, path: str, **kwargs):
        from models.step37.hf_weights import save_hf_weights

        return save_hf_weights(self, path, **kwargs)


def _with_moe_stats(out: StageOutput, stats: list) -> StageOutput:
    if stats:
        out.aux_loss = torch.stack([s["aux_loss"] for s in stats]).sum()
        out.expert_load = torch.stack([s["tokens_per_expert"] for s in stats])
    return out


def _token_loss(logits_TV: torch.Tensor, labels_T: torch.Tensor):
    loss = F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (labels_T != IGNORE_INDEX).sum()


def _next_in_document(layout: DocLayout, device):
    """Index of the next position and whether it is a real token of the same document."""
    T = layout.total
    real_end = torch.zeros(T, dtype=torch.long)
    for s, n, e in zip(layout.starts, layout.lengths, layout.starts[1:] + [T]):
        real_end[s:e] = s + n
    idx = torch.arange(T) + 1
    return idx.clamp(max=T - 1).to(device), (idx < real_end).to(device)


def count_parameters(model: nn.Module, config: Step37Config) -> dict:
    """Total parameters and parameters active per token (embeddings and head included; top-k
    of the routed experts, all of the shared expert), with and without MTP."""
    total = mtp = routed = 0
    specs = model.param_specs()
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if name.startswith("mtp."):
            mtp += n
        elif specs[name].expert_offset is not None:
            routed += n
    active_routed = routed * config.num_experts_per_tok // config.num_experts
    return {"total": total, "total_without_mtp": total - mtp, "mtp": mtp,
            "active_per_token_without_mtp": total - mtp - routed + active_routed}

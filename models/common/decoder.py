"""A decoder-only language model chunk on THD input, built from core's blocks: what every family
shares (single-device maths only; parallelism is applied from outside, see DESIGN.md).

A family subclasses :class:`DecoderLM` and says what is its own: how to build decoder layer
``i`` (:meth:`make_layer`, from ``core.transformer.block.DecoderBlock`` and core's attention, norm,
MLP and MoE options), its final norm, its RoPE parameters per layer type, and optionally blocks
that run after the last layer (multi-token prediction), tied embeddings, and its auxiliary-loss
form. Layers live in a ``ModuleDict`` keyed by global index, so a pipeline stage that owns
layers ``a..b`` has the same parameter names as the whole model.

Forward: ``model(tokens, position_ids, packed_seq_params, images=None)`` -> logits ``[T, vocab]`` (or the
hidden state ``[T, hidden]`` on a stage without the head). With ``labels`` (training) it returns
core's :class:`~core.model_api.StageOutput`: the hidden state to send on, or on the last stage
sums of token cross-entropies and target counts (the caller normalises once per step by the
global token count), plus the MoE layers' auxiliary loss and routing load. The training loss
never forms the logits: ``core/loss.py`` computes linear + cross-entropy a tile of tokens x
vocabulary at a time and keeps an fp32 ``[T]`` logsumexp for backward. ``param_specs``,
``fsdp_units``, ``moe_layers`` and ``blocks`` tell core the rest (``core/model_api.py``).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from core.init import materialize_seeded
from core.finetune.lora import adapter_params
from core.loss import IGNORE_INDEX, linear_cross_entropy
from core.model_api import FSDPUnit, ParamSpec, StageOutput
from core.moe.aux import aux_loss
from core.moe.experts import GroupedExperts
from core.moe.layer import MoELayer
from core.moe.router import TopKRouter
from core.packed_seq import PackedSeqParams
from core.transformer.attention_backends import DocLayout
from core.transformer.block import DecoderBlock
from core.transformer.rotary import RotaryEmbedding


class DecoderLM(nn.Module):
    """The whole decoder, or one pipeline stage of it (``layers``: the global indices it owns;
    ``first``: holds the embedding; ``last``: holds final norm, head and extra blocks;
    ``experts``: the global expert indices whose weights this process holds, all by default).
    Built on the ``meta`` device, then written once on the default device (seeded; nothing is
    allocated when that is ``meta``)."""

    weight_adapter = None   # the family's Hugging Face weight adapter class (core/checkpoint/hf.py)
    aux_scope = "layer"     # core.moe.aux: how the MoE auxiliary loss averages over layers
    router_fp32 = True      # routers compute in fp32 under --bf16 (an FSDP unit of their own)

    def __init__(self, config, *, layers=None, first: bool = True, last: bool = True,
                 experts: range | None = None, seed: int = 0):
        super().__init__()
        self.config = config
        own = list(range(config.num_layers) if layers is None else layers)
        target = torch.get_default_device()  # where the tensors go: built on meta, then written once
        with torch.device("meta"):
            self._build(own, first, last, experts)
        if target.type != "meta":
            materialize_seeded(self, target, seed=seed, std=config.init_std)

    # ------------------------------------------------------------------ what a family provides
    def make_layer(self, index: int, experts: range | None) -> nn.Module:
        raise NotImplementedError

    def make_norm(self) -> nn.Module:
        raise NotImplementedError

    def rope_parameters(self, key: str) -> dict:
        raise NotImplementedError

    @property
    def tied_head(self) -> bool:
        """The output head is the input embedding (``tie_word_embeddings``)."""
        return False

    @property
    def embedding_on_last(self) -> bool:
        """The last stage needs the embedding too (a tied head, or extra blocks that embed)."""
        return self.tied_head

    def build_extra(self, experts: range | None) -> None:
        """Blocks after the last layer, on the last stage: multi-token prediction is a
        ``core.transformer.mtp.MultiTokenPrediction`` held as ``self.mtp`` (the family builds its
        depths' decoder blocks; the methods below run them)."""

    def embed(self, tokens: torch.Tensor, images=None) -> torch.Tensor:
        """The first stage's input embeddings ``[T, hidden]``; a family with a vision tower
        writes image features into them (``images``: ``core.packed_seq.ImageInputs``; an idle one,
        which holds no image, has nothing to write)."""
        if images is not None and not images.is_idle:
            raise ValueError(f"{type(self).__name__} has no vision tower: this micro-batch carries images "
                             "(image + text data needs a model whose config has a vision tower)")
        return self.embed_tokens(tokens)

    def image_parameters(self) -> list[nn.Parameter]:
        """The parameters only images reach (a vision tower's), in the order a backward makes
        their gradients final; none without a tower (``core/model_api.py``)."""
        return []

    def extra_blocks(self) -> list[tuple[int, nn.Module]]:
        mtp = getattr(self, "mtp", None)
        return mtp.blocks() if mtp is not None else []

    def extra_heads(self) -> list[nn.Module]:
        mtp = getattr(self, "mtp", None)
        return mtp.heads() if mtp is not None else []

    def extra_losses(self, out: StageOutput, stats: list, h, tokens, labels, ropes, layout, valid) -> None:
        """Add the extra blocks' losses (and MoE statistics) to ``out``."""
        mtp = getattr(self, "mtp", None)
        if mtp is not None:
            mtp.add_losses(out, stats, self.embed_tokens, h, tokens, labels, ropes, layout, valid)

    # ------------------------------------------------------------------ build
    def _build(self, own: list, first: bool, last: bool, experts: range | None) -> None:
        cfg = self.config
        self.first, self.last = first, last
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) \
            if first or (last and self.embedding_on_last) else None
        self.layers = nn.ModuleDict({str(i): self.make_layer(i, experts) for i in own})
        self.norm = self.make_norm() if last else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if last and not self.tied_head else None
        if last:
            self.build_extra(experts)
        keys = {m.layer_type for m in self.modules() if isinstance(m, DecoderBlock)}
        self.rotary = nn.ModuleDict({k: RotaryEmbedding(cfg.head_dim, self.rope_parameters(k))
                                     for k in sorted(keys)})

    # ------------------------------------------------------------------ what core needs
    def whole_on_meta(self) -> "DecoderLM | None":
        """The whole model on ``meta`` when this is one pipeline stage of it (None when whole):
        what a stage's checkpoint check judges "unexpected" tensors against."""
        if self.first and self.last and len(self.layers) == self.config.num_layers:
            return None
        with torch.device("meta"):
            return type(self)(self.config)

    def param_specs(self) -> dict[str, ParamSpec]:
        """Roles for core (``core/model_api.py``): embedding and heads stay on AdamW; routed
        experts are expert-parallel shards stacked on dim 0 (their LoRA adapters too); an
        embedding the last stage holds too is tied (its gradients are summed with the first
        stage's); LoRA adapters (``core/finetune/lora.py``) have the role ``adapter``."""
        embedding = ParamSpec(role="embedding", tied=self.embedding_on_last)
        heads = [m for m in [self.lm_head, *self.extra_heads()] if m is not None]
        special = {id(m.weight): ParamSpec(role="head") for m in heads}
        if self.embed_tokens is not None:
            special[id(self.embed_tokens.weight)] = embedding
        for m in self.modules():
            if isinstance(m, GroupedExperts):
                spec = ParamSpec(replicated_over="expert_dp", expert_offset=m.expert_offset)
                special.update({id(p): spec for p in m.parameters()})
        adapters = adapter_params(self)  # LoRA (core/finetune/lora.py): the same replicas, trained alone
        return {n: replace(special.get(id(p), ParamSpec()), role="adapter") if id(p) in adapters
                else special.get(id(p), ParamSpec()) for n, p in self.named_parameters()}

    def blocks(self) -> list[tuple[int, nn.Module]]:
        return [(int(i), m) for i, m in self.layers.items()] + self.extra_blocks()

    def fsdp_units(self) -> list[FSDPUnit]:
        """Each block is a unit over DP, its routed experts an inner unit over expert-DP and its
        router an inner unit that computes in fp32 (``router_fp32``); embedding, final norm and
        head fall to the root (the chunk)."""
        units = []
        for _, block in self.blocks():
            for m in block.modules():
                if isinstance(m, GroupedExperts):
                    units.append(FSDPUnit(m, "expert_dp"))
                elif isinstance(m, TopKRouter) and self.router_fp32:
                    units.append(FSDPUnit(m, "dp", fp32=True))
            units.append(FSDPUnit(block, "dp"))
        return units

    def moe_layers(self) -> list[MoELayer]:
        """MoE layers in forward order: the rows of ``StageOutput.expert_load``."""
        return [m for _, block in self.blocks() for m in block.modules() if isinstance(m, MoELayer)]

    # ------------------------------------------------------------------ forward
    def forward(self, tokens=None, position_ids=None, packed_seq_params: PackedSeqParams = None,
                *, hidden=None, labels=None, images=None):
        x, ropes, layout, valid, stats = self._trunk(tokens, position_ids, packed_seq_params, hidden, images)
        if labels is None:
            return self.logits(self.norm(x)) if self.last else x
        if not self.last:
            return self._with_moe_stats(StageOutput(hidden=x), stats)
        loss_sum, num_tokens = linear_cross_entropy(self.norm(x), self.head_weight, labels)
        out = StageOutput(loss_sum=loss_sum, num_tokens=num_tokens)
        self.extra_losses(out, stats, x, tokens, labels, ropes, layout, valid)
        return self._with_moe_stats(out, stats)

    @property
    def head_weight(self) -> torch.Tensor:
        """The output head ``[vocab, hidden]``: ``lm_head``'s, or the input embedding when tied
        (under FSDP the root's gathered copy during the forward)."""
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    def logits(self, h_TH: torch.Tensor) -> torch.Tensor:
        """Full ``[T, vocab]`` logits in the activations' dtype (inference and evaluation of
        logits; the training loss never forms them)."""
        return F.linear(h_TH, self.head_weight)

    def final_hidden(self, tokens, position_ids, packed_seq_params, images=None) -> torch.Tensor:
        """The normalised last hidden state ``[T, hidden]`` (what the head reads)."""
        return self.norm(self._trunk(tokens, position_ids, packed_seq_params, None, images)[0])

    def _trunk(self, tokens, position_ids, packed_seq_params, hidden, images=None):
        layout = DocLayout.from_params(packed_seq_params)
        valid = layout.valid_mask(position_ids.device)
        x = self.embed(tokens, images) if self.first else hidden
        ropes = {t: rope(position_ids, x.dtype) for t, rope in self.rotary.items()}
        stats = []
        for layer in self.layers.values():
            x, s = layer(x, ropes, layout, valid)
            stats += [s] if s is not None else []
        return x, ropes, layout, valid, stats

    def _with_moe_stats(self, out: StageOutput, stats: list) -> StageOutput:
        if stats:
            out.aux_loss = aux_loss(stats, self.aux_scope)
            out.expert_load = torch.stack([s["tokens_per_expert"] for s in stats])
            if self.aux_scope == "model":  # for the executor to combine over pipeline stages
                out.router_counts = out.expert_load.sum(0)
                out.router_probs = torch.stack([s["prob_sum"] for s in stats]).sum(0)
                out.router_layers, out.router_tokens = len(stats), stats[0]["num_valid"]
        return out

    # ------------------------------------------------------------------ weights
    @property
    def hf_weights(self):
        """The weight adapter bound to this chunk's config (what ``core/checkpoint/hf.py`` reads)."""
        return self.weight_adapter(self.config)

    def load_hf(self, path: str, **kwargs) -> dict:
        from core.checkpoint.hf import load_weights

        return load_weights(self, path, **kwargs)

    def save_hf(self, path: str, **kwargs) -> str:
        from core.checkpoint.hf import save_weights

        return save_weights(self, path, **kwargs)


def count_parameters(model: DecoderLM, config=None) -> dict:
    """Total parameters and parameters active per token (embeddings and head included; top-k
    of the routed experts, all of a shared expert), with and without the extra (MTP) blocks."""
    cfg = config or model.config
    extra = {id(p) for _, b in model.extra_blocks() for p in b.parameters()}
    total = mtp = routed = 0
    specs = model.param_specs()
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if id(p) in extra:
            mtp += n
        elif specs[name].expert_offset is not None:
            routed += n
    active_routed = routed * cfg.num_experts_per_tok // cfg.num_experts if cfg.num_experts else 0
    return {"total": total, "total_without_mtp": total - mtp, "mtp": mtp,
            "active_per_token_without_mtp": total - mtp - routed + active_routed}

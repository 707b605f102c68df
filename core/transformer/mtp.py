"""Multi-token prediction (DeepSeek-V3 style) as a building block a decoder family puts after its
last layer: depth k = 1..D computes ``h_k = block_k(eh_proj([enorm(embed(x shifted by k)),
hnorm(h_{k-1})]))`` with ``h_0`` the main model's last hidden state before the final norm, and
depth k's logits at position t predict token t + k + 1. Shifts stay inside each document: a
position whose shifted input or target would come from the next document gets padding and no
target. Each depth's head computes its loss a tile at a time (``core/loss.py``: no ``[T, vocab]``
logits); under ``--recompute-granularity full`` everything of a depth before its head is
recomputed in the backward (the depth keeps its inputs and its head's input), under
``selective`` its decoder block drops its internals.

A family builds the depths' decoder blocks and its norm (what is its own) and holds them as a
:class:`MultiTokenPrediction` (``models/common/decoder.py`` does the rest: the depths are extra
blocks, their heads extra heads, their losses extra losses). Parameter names are
``<k>.enorm``, ``<k>.hnorm``, ``<k>.eh_proj``, ``<k>.block``, ``<k>.head_norm``, ``<k>.head``
under wherever the family puts it (the published checkpoints' layout, via its weight adapter).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from core.loss import IGNORE_INDEX, linear_cross_entropy
from core.transformer.attention_backends import DocLayout
from core.transformer.block import RecomputeUnit


class MTPDepth(RecomputeUnit):
    """One depth: ``block`` is the family's decoder block for it, ``norm()`` makes the family's
    norm (``enorm``, ``hnorm`` and ``head_norm`` each get one)."""

    def __init__(self, hidden_size: int, vocab_size: int, block: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.enorm = norm()
        self.hnorm = norm()
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.head_norm = norm()
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, emb_TH, h_prev_TH, ropes, layout, valid_T, labels_T):
        """(hidden state for the next depth, this depth's summed token loss and target count,
        MoE statistics or None). The head runs inside the forward so a wrapper that gathers this
        module's weights (FSDP) covers it; it stays outside the recomputed part, whose rerun
        would otherwise add a pass over the vocabulary to the one the loss's backward makes."""
        h, h_norm, stats = self.recomputed(self._trunk, emb_TH, h_prev_TH, ropes, layout, valid_T)
        loss, count = linear_cross_entropy(h_norm, self.head.weight, labels_T)
        return h, loss, count, stats

    def _trunk(self, emb_TH, h_prev_TH, ropes, layout, valid_T):
        x = self.eh_proj(torch.cat([self.enorm(emb_TH), self.hnorm(h_prev_TH)], dim=-1))
        h, stats = self.block(x, ropes, layout, valid_T)
        return h, self.head_norm(h), stats


class MultiTokenPrediction(nn.ModuleDict):
    """The depths, keyed ``"0"``..``"D-1"``, run one after another after the main model's last
    layer."""

    def __init__(self, depths: list[MTPDepth]):
        super().__init__({str(k): d for k, d in enumerate(depths)})

    def blocks(self) -> list[tuple[int, nn.Module]]:
        """``(-1 - k, depth k)``: the ids ``core/model_api.py`` gives blocks after the last layer."""
        return [(-1 - int(k), d) for k, d in self.items()]

    def heads(self) -> list[nn.Module]:
        return [d.head for d in self.values()]

    def add_losses(self, out, stats: list, embed: nn.Module, h, tokens, labels, ropes, layout: DocLayout,
                   valid) -> None:
        """Each depth's summed loss and target count appended to ``out`` (a ``StageOutput``), its
        MoE statistics to ``stats``. ``h``: the main model's last hidden state (before the final
        norm); ``embed``: the input embedding. A context-parallel shard brings its shifted inputs
        and labels (made on the whole pack, ``data/cp_shard.py``)."""
        cp = layout.params.cp
        if cp is not None and (cp.mtp_inputs is None or cp.mtp_inputs.shape[0] < len(self)):
            raise ValueError(f"the context-parallel shard carries no shifted inputs for {len(self)} MTP "
                             f"depths: shard it with mtp_depths={len(self)} (data/cp_shard.py)")
        nxt, ok = next_in_document(layout, tokens.device) if cp is None else (None, None)
        shifted_tokens, shifted_labels = tokens, labels
        for k, depth in enumerate(self.values(), start=1):
            if cp is not None:
                shifted_tokens, shifted_labels = cp.mtp_inputs[k - 1], cp.mtp_labels[k - 1]
            else:
                shifted_tokens = torch.where(ok, shifted_tokens[nxt], torch.zeros_like(tokens))
                shifted_labels = torch.where(ok, shifted_labels[nxt], torch.full_like(labels, IGNORE_INDEX))
            h, loss, n, s = depth(embed(shifted_tokens), h, ropes, layout, valid, shifted_labels)
            stats += [s] if s is not None else []
            out.mtp_loss_sums.append(loss)
            out.mtp_num_tokens.append(n)


def next_in_document(layout: DocLayout, device):
    """Index of the next position and whether it is a real token of the same document, computed
    on ``device`` from the layout's device boundaries (no host-to-device copy mid-forward)."""
    T = layout.total
    idx = torch.arange(1, T + 1, device=device)
    return idx.clamp(max=T - 1), idx < layout.real_end(device)

"""Sigmoid top-k router (Step-3.x / DeepSeek-V3 style).

Logits in fp32; scores ``sigmoid(logits)``; experts are *chosen* by ``score + bias`` (the
aux-loss-free balancing bias, a buffer updated outside autograd) but *weighted* by the unbiased
scores of the chosen experts, renormalised to sum to 1. Padding tokens take part in the maths
(their outputs are never read) but not in the load statistics or the auxiliary loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.precision import KeepFP32Buffers


class SigmoidRouter(KeepFP32Buffers):
    fp32_buffers = ("e_score_correction_bias",)  # a balancing state: bf16 would round its steps away

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x_TH: torch.Tensor, valid_T: torch.Tensor | None = None):
        """Returns ``(weights_TK fp32, experts_TK int64, stats)``; ``stats`` holds per-expert
        token counts and the switch-style aux loss over valid tokens (both tensors, no sync)."""
        # fp32 logits from fp32 weights (under --bf16 the router is its own fp32 FSDP unit)
        logits = F.linear(x_TH.to(self.weight.dtype), self.weight).float()
        scores = torch.sigmoid(logits)
        _, experts = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1)
        weights = scores.gather(1, experts)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        stats = self._stats(scores, experts, valid_T)
        return weights, experts, stats

    def _stats(self, scores_TE, experts_TK, valid_T):
        E, K = self.num_experts, self.top_k
        f32 = dict(dtype=torch.float32, device=experts_TK.device)
        keep = torch.ones(experts_TK.shape[0], **f32) if valid_T is None else valid_T.to(torch.float32)
        counts = torch.zeros(E, **f32).index_add(
            0, experts_TK.flatten(), keep.repeat_interleave(K))
        n = keep.sum().clamp(min=1)
        # aux = E * sum_e f_e * P_e; f: share of routed slots, P: mean normalised score
        probs = scores_TE / scores_TE.sum(-1, keepdim=True).clamp(min=1e-20)
        mean_prob = (probs * keep[:, None]).sum(0) / n
        aux = E * (counts / (n * K) * mean_prob).sum()
        return {"tokens_per_expert": counts, "aux_loss": aux}

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower the others."""
        if rate:
            load = tokens_per_expert.float()
            self.e_score_correction_bias += rate * torch.sign(load.mean() - load)

"""Top-k routers, in the two forms MoE families use:

* ``score="sigmoid"`` (Step-3.x / DeepSeek-V3): scores ``sigmoid(logits)``; experts are *chosen*
  by ``score + bias`` (``correction_bias``: the aux-loss-free balancing bias, a buffer updated
  outside autograd) but *weighted* by the unbiased scores of the chosen experts, renormalised to
  sum to 1;
* ``score="softmax"`` (Qwen / Mixtral): scores ``softmax(logits)``; the top-k scores are the
  weights, renormalised to sum to 1 only with ``renormalize`` (Qwen3's ``norm_topk_prob``).

Group-limited top-k (DeepSeek-V3's ``n_group`` / ``topk_group``, transformers'
``DeepseekV3TopkRouter``): the experts are cut into ``groups`` equal groups of consecutive
indices; each group is ranked by the sum of its two best choice scores (``score + bias`` for
sigmoid), only the ``topk_groups`` best groups stay eligible, and the top-k is taken among their
experts. ``groups=1`` is the plain top-k. The routed output's ``routed_scaling_factor`` is the MoE
layer's ``scaling`` (``core/moe/layer.py``); the bias update (:meth:`TopKRouter.update_bias`)
reads only the load, so it applies to every form.

Logits in fp32 from the router's own weights (under ``--bf16`` the router is an fp32 FSDP unit).
Padding tokens take part in the maths (their outputs are never read) but not in the load
statistics or the auxiliary losses. Under context parallelism the load statistics are the whole
pack's (summed over the CP group, ``stats_group``), so the auxiliary loss is the pack's too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from core.precision import KeepFP32Buffers

SCORES = ("sigmoid", "softmax")


class TopKRouter(KeepFP32Buffers):
    fp32_buffers = ("e_score_correction_bias",)  # a balancing state: bf16 would round its steps away
    stats_group = None  # context parallelism: the CP group, over which load statistics are summed

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, score: str = "sigmoid",
                 correction_bias: bool = True, renormalize: bool = True, groups: int = 1,
                 topk_groups: int = 1):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"router score {score!r}: expected one of {', '.join(SCORES)}")
        check_groups(num_experts, top_k, groups, topk_groups)
        self.num_experts, self.top_k = num_experts, top_k
        self.groups, self.topk_groups = groups, topk_groups
        self.score, self.renormalize = score, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None

    def reset_buffers(self, device) -> None:
        """The balancing bias starts at zero (a checkpoint that has it overwrites it)."""
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias = torch.zeros(self.num_experts, device=device)

    def forward(self, x_TH: torch.Tensor, valid_T: torch.Tensor | None = None):
        """Returns ``(weights_TK fp32, experts_TK int64, stats)``; ``stats`` (tensors, no sync):
        ``tokens_per_expert`` (routed slots over valid tokens), ``prob_sum`` (each expert's
        normalised score summed over valid tokens, differentiable), ``num_valid`` and
        ``aux_loss``, this layer's switch-style auxiliary loss."""
        logits = F.linear(x_TH.to(self.weight.dtype), self.weight).float()
        if self.score == "sigmoid":
            scores = torch.sigmoid(logits)
            choose = scores if self.e_score_correction_bias is None else \
                scores + self.e_score_correction_bias.float()
            _, experts = torch.topk(self._eligible(choose), self.top_k, dim=-1)
            weights = scores.gather(1, experts)
        else:
            scores = torch.softmax(logits, dim=-1)
            if self.groups > 1:
                _, experts = torch.topk(self._eligible(scores), self.top_k, dim=-1)
                weights = scores.gather(1, experts)
            else:
                weights, experts = torch.topk(scores, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts, self._stats(scores, experts, valid_T)

    def _eligible(self, choose_TE: torch.Tensor) -> torch.Tensor:
        """``choose_TE`` with the experts outside each token's ``topk_groups`` best groups at
        -inf (a group's rank: the sum of its two best scores); unchanged with one group."""
        if self.groups == 1:
            return choose_TE
        T = choose_TE.shape[0]
        grouped_TGn = choose_TE.view(T, self.groups, -1)
        rank_TG = grouped_TGn.topk(2, dim=-1).values.sum(-1)
        kept_TG = torch.zeros_like(rank_TG, dtype=torch.bool).scatter_(
            1, rank_TG.topk(self.topk_groups, dim=-1).indices, True)
        return grouped_TGn.masked_fill(~kept_TG[:, :, None], float("-inf")).view(T, -1)

    def _stats(self, scores_TE, experts_TK, valid_T):
        E, K = self.num_experts, self.top_k
        f32 = dict(dtype=torch.float32, device=experts_TK.device)
        keep = torch.ones(experts_TK.shape[0], **f32) if valid_T is None else valid_T.to(torch.float32)
        counts = torch.zeros(E, **f32).index_add(
            0, experts_TK.flatten(), keep.repeat_interleave(K))
        n = keep.sum()
        if self.stats_group is not None:  # context parallel: the whole pack's counts (no gradient)
            both = torch.cat([counts, n.reshape(1)])
            dist.all_reduce(both, group=self.stats_group)
            counts, n = both[:-1], both[-1]
        probs = scores_TE if self.score == "softmax" else \
            scores_TE / scores_TE.sum(-1, keepdim=True).clamp(min=1e-20)
        return router_stats(counts, (probs * keep[:, None]).sum(0), n, K)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower the others."""
        if rate and self.e_score_correction_bias is not None:
            load = tokens_per_expert.float()
            self.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def check_groups(num_experts: int, top_k: int, groups: int, topk_groups: int) -> None:
    """Group-limited routing's shape rules (one line each, naming the config fields)."""
    if groups < 1 or num_experts % groups:
        raise ValueError(f"n_group {groups} must be >= 1 and divide the {num_experts} routed experts")
    if groups > 1 and num_experts // groups < 2:
        raise ValueError(f"n_group {groups}: each group needs >= 2 experts (groups rank by their top-2)")
    if not 1 <= topk_groups <= groups:
        raise ValueError(f"topk_group {topk_groups} must be in [1, n_group={groups}]")
    if top_k > topk_groups * (num_experts // groups):
        raise ValueError(f"num_experts_per_tok {top_k} > the {topk_groups * (num_experts // groups)} experts "
                         f"of topk_group={topk_groups} groups: lower it or raise topk_group")


def router_stats(counts_E, prob_sum_E, valid_tokens, top_k: int) -> dict:
    """A router's statistics from its sums over tokens (also how chunks of a micro-batch combine:
    ``core/transformer/chunked.py``). aux = E * sum_e f_e * P_e; f: share of routed slots, P: mean
    normalised score. Under CP, f and n are the pack's and prob_sum this shard's: the CP ranks'
    aux losses sum to the pack's, and each one's gradient is its shard's part of the pack's."""
    n = valid_tokens.clamp(min=1)
    aux = counts_E.numel() * (counts_E / (n * top_k) * (prob_sum_E / n)).sum()
    return {"tokens_per_expert": counts_E, "prob_sum": prob_sum_E, "num_valid": n, "aux_loss": aux,
            "valid_tokens": valid_tokens}

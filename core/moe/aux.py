"""The MoE auxiliary (load-balancing) loss of a chunk, from its layers' router statistics
(:meth:`core.moe.router.TopKRouter.forward`), in the two forms families use. Padding tokens are
excluded from both (the routers' valid-token mask).

* ``"layer"`` (Switch Transformer per layer, summed; Step-3.x): ``sum_l E * sum_e f_le * P_le``
  with ``f_le`` layer l's share of routed slots going to expert e and ``P_le`` its mean
  normalised score;
* ``"model"`` (transformers' ``load_balancing_loss_func``: Qwen-MoE, Mixtral): one loss over the
  layers together, ``E * sum_e f_e * P_e`` with ``f_e`` the routed slots to expert e per token
  and ``P_e`` the mean score, both averaged over every MoE layer (``f`` sums to top-k). The
  average runs over the layers of one chunk here; across pipeline stages the executor carries
  the counts with its messages (``core/pipeline/executor.py``) and each stage adds
  :func:`model_aux_share` of the whole model's loss, which sums to transformers' exactly.
"""
from __future__ import annotations

import torch

AUX_SCOPES = ("layer", "model")


def aux_loss(stats: list[dict], scope: str = "layer") -> torch.Tensor:
    if scope == "layer":
        return torch.stack([s["aux_loss"] for s in stats]).sum()
    if scope != "model":
        raise ValueError(f"aux loss scope {scope!r}: expected one of {', '.join(AUX_SCOPES)}")
    counts = torch.stack([s["tokens_per_expert"] for s in stats]).sum(0)
    probs = torch.stack([s["prob_sum"] for s in stats]).sum(0)
    return model_aux_share(counts, probs, len(stats), stats[0]["num_valid"])


def model_aux_share(counts: torch.Tensor, probs: torch.Tensor, layers, tokens) -> torch.Tensor:
    """``E * sum_e (counts_e / (L n)) * (probs_e / (L n))``: the model-wide loss when ``probs``
    sums every layer's scores, or a stage's exact share of it when ``probs`` sums its layers'
    (``counts``: routed slots over every layer, detached; ``layers``: L; ``tokens``: n valid)."""
    rows = layers * tokens
    return counts.numel() * ((counts.detach() / rows) * (probs / rows)).sum()

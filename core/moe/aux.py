"""The MoE auxiliary (load-balancing) loss of a chunk, from its layers' router statistics
(:meth:`core.moe.router.TopKRouter.forward`), in the two forms families use. Padding tokens are
excluded from both (the routers' valid-token mask).

* ``"layer"`` (Switch Transformer per layer, summed; Step-3.x): ``sum_l E * sum_e f_le * P_le``
  with ``f_le`` layer l's share of routed slots going to expert e and ``P_le`` its mean
  normalised score;
* ``"model"`` (transformers' ``load_balancing_loss_func``: Qwen-MoE, Mixtral): one loss over the
  layers together, ``E * sum_e f_e * P_e`` with ``f_e`` the routed slots to expert e per token
  and ``P_e`` the mean score, both averaged over every MoE layer (``f`` sums to top-k). The
  average runs over the layers of one chunk: it equals transformers' when the chunk holds every
  MoE layer of the model (no pipeline split), which ``training`` checks before a run uses it.
"""
from __future__ import annotations

import torch

AUX_SCOPES = ("layer", "model")


def aux_loss(stats: list[dict], scope: str = "layer") -> torch.Tensor:
    if scope == "layer":
        return torch.stack([s["aux_loss"] for s in stats]).sum()
    if scope != "model":
        raise ValueError(f"aux loss scope {scope!r}: expected one of {', '.join(AUX_SCOPES)}")
    rows = len(stats) * stats[0]["num_valid"]
    f = torch.stack([s["tokens_per_expert"] for s in stats]).sum(0) / rows
    p = torch.stack([s["prob_sum"] for s in stats]).sum(0) / rows
    return f.numel() * (f * p).sum()

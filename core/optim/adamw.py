"""AdamW over exact fp32 masters: torch's own AdamW maths (``torch.optim.adamw.adamw``, so
updates equal ``torch.optim.AdamW``'s) and its state layout (``step``, ``exp_avg``,
``exp_avg_sq``, shaped and sharded like the parameter, fp32), applied to each parameter's fp32
master: its own storage when it is fp32, or its bf16 value joined with its remainder
(``core/optim/masters.py``) when ``--store-param-remainders`` keeps it in 4 bytes, or the host
copy (``--cpu-offload masters``). Parameters that are their own masters step together, one
``foreach`` call per group on their local shards (about a dozen kernels for the group, where one
parameter at a time launches about ten per parameter: hundreds of norms and biases); the others
one at a time through their master storage (one fp32 temporary at a time, or host threads).
bf16 gradients are taken to fp32 first, and a clipping factor the gradients did not receive
(``grad_scale``) is applied there, in fp32."""
from __future__ import annotations

import torch
from torch.optim import Optimizer
from torch.optim.adamw import adamw

from core.distributed.grads import local
from core.optim.host_masters import HostMasters, zeros_like_on
from core.optim.masters import NO_MASTERS


def fp32_grad(p, scale) -> torch.Tensor:
    """This rank's gradient of ``p`` in fp32; ``scale`` (a clip factor) multiplies a gradient
    that is not fp32 (fp32 gradients were clipped in place)."""
    g = local(p.grad)
    if g.dtype == torch.float32:
        return g
    g = g.float()
    return g if scale is None else g * scale.to(g.device)


class AdamW(Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, masters=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.masters = masters or NO_MASTERS
        self.grad_scale = None  # clip factor for gradients that were not clipped in place

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            ready = [p for p in group["params"] if p.grad is not None]
            self.update_many([p for p in ready if p not in self.masters], group)
            for p in ready:
                if p in self.masters:
                    self.update(p, group)
        return loss

    def _state(self, p) -> dict:
        """torch's AdamW state, fp32, where the master lives (the device, or the host)."""
        state = self.state[p]
        if not state:
            device = self.masters.state_device(p)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"], state["exp_avg_sq"] = zeros_like_on(p, device), zeros_like_on(p, device)
        return state

    @torch.no_grad()
    def update_many(self, params: list, group) -> None:
        """One ``foreach`` update of parameters that are their own fp32 masters (their local
        shards: plain tensors, so no DTensor dispatch per op)."""
        if not params:
            return
        states = [self._state(p) for p in params]
        beta1, beta2 = group["betas"]
        adamw([local(p) for p in params], [fp32_grad(p, self.grad_scale) for p in params],
              [local(s["exp_avg"]) for s in states], [local(s["exp_avg_sq"]) for s in states], [],
              [s["step"] for s in states], foreach=True, capturable=False, differentiable=False, fused=None,
              amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
              eps=group["eps"], maximize=False)

    @torch.no_grad()
    def update(self, p, group) -> None:
        state = self._state(p)
        beta1, beta2 = group["betas"]
        avg, avg_sq, step = local(state["exp_avg"]), local(state["exp_avg_sq"]), state["step"]

        def apply(m, g):
            adamw([m], [g], [avg], [avg_sq], [], [step], foreach=False, capturable=False, differentiable=False,
                  fused=None, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        g, scale = local(p.grad), self.grad_scale
        if g.dtype == torch.bfloat16 and isinstance(self.masters, HostMasters) and p in self.masters:
            # host masters: the bf16 gradient crosses to the host (its staging slot holds bf16) and
            # becomes fp32 there, times the clip factor in fp32: fp32_grad's values exactly
            def apply_host(m, g16, *factor):
                g32 = g16.float()
                apply(m, g32 * factor[0] if factor else g32)
            self.masters.update(p, apply_host, g, *(() if scale is None else (scale,)))
            return
        self.masters.update(p, apply, fp32_grad(p, self.grad_scale))

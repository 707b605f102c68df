"""Freezing whole parts of a model (``--freeze-vision``, ``--freeze-projector``,
``--freeze-language``): their parameters stop requiring a gradient before FSDP wraps them, so,
as a LoRA run's frozen base (``core/finetune/lora.py``), they get no gradient, no optimizer state
(``core/optim/build.py``) and no gradient reduction, and under ``--bf16`` are stored in bf16
(``core.finetune.lora.frozen_to_bf16``: their one copy, never updated). Unlike a LoRA base they are saved
in checkpoints (a run's checkpoint holds the whole model).

A model names its parts with ``param_parts()`` (``core/model_api.py``): part -> parameter names;
every FSDP unit holds one part only, so a frozen part is whole units.
"""
from __future__ import annotations

from torch import nn

PARTS = ("vision", "projector", "language")


def model_parts(model: nn.Module) -> dict[str, list[str]]:
    """Part -> parameter names; a model without ``param_parts`` is one ``language`` part."""
    if hasattr(model, "param_parts"):
        return model.param_parts()
    return {"language": [n for n, _ in model.named_parameters()]}


def freeze_parts(model: nn.Module, parts) -> int:
    """Stop gradients to every parameter of ``parts``; returns how many were frozen."""
    names = {n for part, found in model_parts(model).items() if part in set(parts) for n in found}
    n = 0
    for name, p in model.named_parameters():
        if name in names and p.requires_grad:
            p.requires_grad_(False)
            n += 1
    return n


def check_freeze(model: nn.Module, parts) -> None:
    """``ValueError`` naming the flag when a part to freeze is absent from ``model`` (the whole
    model, built on meta) or nothing would be left to train."""
    parts = list(parts)
    if not parts:
        return
    have = {k: len(v) for k, v in model_parts(model).items()}
    absent = [p for p in parts if not have.get(p)]
    if absent:
        raise ValueError(f"--freeze-{absent[0]}: the model has no {absent[0]} part (it has "
                         f"{', '.join(k for k, n in have.items() if n)}); a text-only config has no vision "
                         "tower or projector")
    if all(not n or k in parts for k, n in have.items()):
        raise ValueError(f"{' '.join('--freeze-' + p for p in parts)}: nothing would be left to train")


def check_router_bias(rate: float, parts, lora: bool, build) -> None:
    """``ValueError`` naming ``--moe-bias-update-rate`` where no router would take it: a frozen
    router keeps its balancing bias (``core.train_step.update_router_biases``), LoRA freezes every
    router (and a PEFT export has no place for the biases), ``--freeze-*`` those of its parts.
    ``build``: the whole model (called on ``meta``, only with parts to freeze)."""
    if not rate:
        return
    if lora:
        raise ValueError(f"--moe-bias-update-rate {rate:g} with --lora-rank: LoRA freezes the routers, and a PEFT "
                         "export carries no router bias (transformers would route by the base's): set "
                         "--moe-bias-update-rate 0 for LoRA")
    if not parts:
        return
    import torch

    with torch.device("meta"):
        model = build()
    freeze_parts(model, parts)
    if not any(p.requires_grad for layer in model.moe_layers() for p in layer.router.parameters()):
        raise ValueError(f"--moe-bias-update-rate {rate:g} with {' '.join('--freeze-' + p for p in parts)}: every "
                         "router is in a frozen part, whose balancing bias stays as loaded: drop "
                         "--moe-bias-update-rate")

"""LoRA adapters out of this project: merged into the base weights (``merge_lora``: the model is a
plain model again, for a Hugging Face export), or as a PEFT adapter folder (``write_peft``:
``adapter_config.json`` + ``adapter_model.safetensors`` under PEFT's names for transformers'
modules, which the family's weight adapter gives: ``peft_module(name)`` when it has one (the
module path in the model transformers builds from the export; None for a module transformers
does not have, whose adapter is left out), else the name among its published ones that the base
checkpoint holds).

PEFT's keys: ``base_model.model.<transformers module>.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]``, scale ``lora_alpha / r``: ours exactly. Routed experts' grouped
adapters are written per expert under the published per-expert module names
(``...experts.7.gate_proj``): the form PEFT (0.21, checked) converts itself onto transformers 5's
fused experts (``target_parameters`` on ``gate_up_proj`` / ``down_proj``, gate and up adapters
stacked at rank 2r). A family that publishes its experts stacked has no such names, and where a
family publishes them per expert, PEFT's conversion takes every target of an expert projection's
name (``gate_proj``, ``up_proj``, ``down_proj``) for the experts, adapted or not, so it drops the
adapter of a dense MLP or shared expert of that name (measured on DeepSeek-V3 and Qwen3-MoE: the
PEFT-loaded logits were the base's): ``write_peft`` refuses both rather than write an adapter PEFT
loads wrongly, and points to ``--merge-lora``. Reading a PEFT folder back (``read_peft``) takes
such adapters as they are: our model applies them."""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from core.finetune.lora import LoRAGroupedExperts, LoRALinear
from core.moe.experts import GroupedExperts

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight (``W + (alpha / r) B A``, computed in fp32, rounded
    once to the weight's dtype) and put the plain modules back (the same parameter names as the
    base model); returns the number of modules merged."""
    merged = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                w = child.weight
                w.copy_((w.float() + child.scale * (child.lora_B.float() @ child.lora_A.float())).to(w.dtype))
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                plain.weight, plain.bias = child.weight, child.bias
            elif isinstance(child, LoRAGroupedExperts):
                for n in child.PROJECTIONS:
                    w = getattr(child, n)
                    delta = torch.bmm(child.lora_B[n].float(), child.lora_A[n].float())
                    w.copy_((w.float() + child.scale * delta).to(w.dtype))
                plain = GroupedExperts.__new__(GroupedExperts)
                nn.Module.__init__(plain)
                plain.num_experts, plain.limit, plain.expert_offset = child.num_experts, child.limit, child.expert_offset
                plain.use_grouped_mm = child.use_grouped_mm
                for n in child.PROJECTIONS:
                    setattr(plain, n, getattr(child, n))
            else:
                continue
            setattr(parent, name, plain)
            merged += 1
    for p in model.parameters():
        p.requires_grad_(True)
    return merged


def _source(model, name: str, keys: set | None, expert: int | None = None) -> str:
    """The checkpoint name of our tensor ``name``: the first of the weight adapter's sources that
    the base checkpoint holds (``keys``: its tensor names; the module paths of the transformers
    model it loads into), else the first (the published layout)."""
    sources = [s.name for s in model.hf_weights.sources(name)]
    for src in sources if keys else ():
        if src.replace("{e}", str(expert or 0)) in keys:
            return src
    return sources[0]


def peft_entries(model, keys: set | None = None, *,
                 for_peft: bool = True) -> list[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """``(transformers module, our target, A, B)`` of every adapter of ``model``, routed experts one
    entry per expert (``A`` and ``B`` views of the stacks); ``keys``: the base checkpoint's tensor
    names, which choose among the names a family publishes (e.g. Step-3.7's text model's or the
    full model's). ``for_peft``: refuse what PEFT would load wrongly (the module docstring)."""
    entries, expert_leaves = [], set()
    for name, m in model.named_modules():
        if isinstance(m, GroupedExperts):  # adapted or not: their published per-expert leaf names
            for n in m.PROJECTIONS:
                src = _source(model, f"{name}.{n}", keys, m.expert_offset)
                if "{e}" in src and src.endswith(".weight"):
                    expert_leaves.add(src.rsplit(".", 2)[-2])
        if isinstance(m, LoRAGroupedExperts):
            for n in m.PROJECTIONS:
                src = _source(model, f"{name}.{n}", keys, m.expert_offset)
                if "{e}" not in src or not src.endswith(".weight"):
                    raise ValueError(f"{name}.{n}: the routed experts are published stacked ({src}), so PEFT has no "
                                     "per-expert module to adapt: export the merged weights with --merge-lora, or "
                                     "train with --lora-targets without experts")
                for i in range(m.num_experts):
                    module = src[:-len(".weight")].replace("{e}", str(m.expert_offset + i))
                    entries.append((module, "experts", m.lora_A[n].detach()[i], m.lora_B[n].detach()[i]))
        elif isinstance(m, LoRALinear):
            peft_module = getattr(model.hf_weights, "peft_module", None)
            if peft_module is not None:  # the family names transformers' modules itself
                module = peft_module(f"{name}.weight")
                if module is not None:  # None: transformers has no such module (e.g. an MTP depth)
                    entries.append((module, m.lora_target, m.lora_A.detach(), m.lora_B.detach()))
                continue
            published = _source(model, f"{name}.weight", keys)
            if not published.endswith(".weight"):
                raise ValueError(f"{name}.weight is published as {published!r}: not a linear module's weight, "
                                 "so PEFT has no module to adapt; use --merge-lora")
            entries.append((published[:-len(".weight")], m.lora_target, m.lora_A.detach(), m.lora_B.detach()))
    if not entries:
        raise ValueError("the model has no LoRA adapter to export")
    clash = sorted((e[0], e[1]) for e in entries if e[0].rsplit(".", 1)[-1] in expert_leaves and e[1] != "experts")
    if clash and for_peft:  # PEFT on transformers 5 takes every target of an expert projection's name for the experts
        raise ValueError(f"{clash[0][0]}: a dense projection named like the routed experts' "
                         f"({', '.join(sorted(expert_leaves))}); PEFT maps such targets onto transformers' fused "
                         "experts, so it would drop this adapter: export the merged weights with --merge-lora, or "
                         f"train with --lora-targets without {', '.join(sorted({t for _, t in clash}))}")
    return entries


def _keys(module: str) -> tuple[str, str]:
    return f"base_model.model.{module}.lora_A.weight", f"base_model.model.{module}.lora_B.weight"


def peft_tensors(model, keys: set | None = None) -> tuple[dict, list]:
    """PEFT's adapter tensors (fp32, contiguous) and the transformers modules they adapt."""
    tensors = {}
    entries = peft_entries(model, keys)
    for module, _, A, B in entries:
        ka, kb = _keys(module)
        tensors[ka], tensors[kb] = A.float().contiguous().cpu(), B.float().contiguous().cpu()
    return tensors, [e[0] for e in entries]


def read_peft_config(folder: str) -> dict:
    """A PEFT LoRA folder's config, with what this reader cannot take refused by name."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    with open(path) as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}, expected LORA")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"{path}: {key} {config[key]} (per-module ranks or alphas) is not supported: one rank "
                             "and alpha for every adapter")
    for key in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(key):
            raise ValueError(f"{path}: {key} is not supported (plain LoRA only)")
    return config


def base_keys(base: str | None, model) -> set | None:
    """The tensor names of the HF checkpoint ``base`` (None without one)."""
    if not base:
        return None
    from core.checkpoint.hf import open_checkpoint

    return set(open_checkpoint(model, base).file_of)


def adapted_targets(model, folder: str, keys: set | None = None) -> list[str]:
    """Our ``--lora-targets`` that the PEFT folder's tensors cover (``model``: adapted with every
    target)."""
    from safetensors import safe_open

    base = keys
    with safe_open(os.path.join(folder, ADAPTER_WEIGHTS), "pt") as f:
        keys = set(f.keys())
    return sorted({t for module, t, _, _ in peft_entries(model, base, for_peft=False) if _keys(module)[0] in keys})


@torch.no_grad()
def read_peft(model, folder: str, keys: set | None = None) -> int:
    """Fill ``model``'s adapters from a PEFT folder (as ``write_peft`` writes it); a tensor the
    model needs and the folder lacks, or one the folder has and the model does not use, is an
    error naming it. Returns the number of tensors read."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(folder, ADAPTER_WEIGHTS))
    used = set()
    for module, _, A, B in peft_entries(model, keys, for_peft=False):
        for key, dst in zip(_keys(module), (A, B)):
            if key not in tensors:
                raise ValueError(f"{folder}: {ADAPTER_WEIGHTS} has no {key}")
            if tuple(tensors[key].shape) != tuple(dst.shape):
                raise ValueError(f"{folder}: {key} is {list(tensors[key].shape)}, the model's is {list(dst.shape)}")
            dst.copy_(tensors[key])
            used.add(key)
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(f"{folder}: tensors the model has no adapter for, e.g. {unused[:3]} (other --lora-targets?)")
    return len(used)


def task_type(base: str | None) -> str:
    """PEFT's task of the base: a language model with a head (``...ForCausalLM``,
    ``...ForConditionalGeneration``) is CAUSAL_LM; a base model without one (Step-3.7's text
    export, ``Step3p7TextModel``) FEATURE_EXTRACTION."""
    path = os.path.join(base, "config.json") if base else None
    if path and os.path.exists(path):
        with open(path) as f:
            arch = (json.load(f).get("architectures") or [""])[0]
        if arch and not arch.endswith(("ForCausalLM", "ForConditionalGeneration")):
            return "FEATURE_EXTRACTION"
    return "CAUSAL_LM"


def write_peft(model, out: str, *, rank: int, alpha: float, dropout: float, base: str | None) -> dict:
    """Write ``model``'s adapters as a PEFT LoRA folder ``out``; returns the adapter config. Files an
    earlier export of either kind left there (``core.checkpoint.out_dir``: a full export's weights, shards,
    index, config.json, side files) are removed first: transformers would load the folder as a
    model, or the weights beside the adapter."""
    from safetensors.torch import save_file

    from core.checkpoint.out_dir import clear_owned, export_files

    tensors, modules = peft_tensors(model, base_keys(base, model))
    config = {"peft_type": "LORA", "task_type": task_type(base), "base_model_name_or_path": base,
              "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": sorted(modules),
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
              "use_rslora": False, "use_dora": False, "modules_to_save": None}
    os.makedirs(out, exist_ok=True)
    clear_owned(out, export_files(getattr(model.hf_weights, "side_files", ())))
    save_file(tensors, os.path.join(out, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return config

"""Model families by name: what the trainer, the planner and the tools ask instead of importing
a family (TorchTitan's ``ModelSpec``).

A family is one folder ``models/<family>/`` whose ``__init__.py`` defines ``SPEC``, a
:class:`ModelSpec`: its config class (Hugging Face ``config.json`` both ways, presets), its model
chunk class (``models/common/decoder.py``; the weight adapter rides on it as ``weights``) and its
shapes for the cost models. The family of a run comes from ``--hf-config``'s ``model_type``, or
from the preset's name; checkpoints record it. A family outside this project registers itself:
``register(spec)`` in a module named by ``--model-module``.

What every family's config provides (the generic code reads only these): ``num_layers``,
``hidden_size``, ``vocab_size``, ``head_dim``, ``num_experts`` (0: dense), ``num_experts_per_tok``,
``num_mtp_layers`` (extra blocks after the last layer), ``max_position_embeddings``,
``attention_backend``, ``init_std``, ``aux_loss_coeff`` (its default router auxiliary-loss
weight), ``to_dict()`` and ``to_hf()``; the class gives ``from_hf(path_or_dict, **overrides)`` and
``preset(name)``.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Callable

BUILT_IN = ("models.step37", "models.qwen3_moe", "models.deepseek_v3", "models.glm4_moe")
LEGACY_FAMILY = "step37"  # what checkpoints hold that were written before families were recorded


@dataclass(frozen=True)
class ModelSpec:
    family: str                      # the name checkpoints record, e.g. "step37"
    config_class: type               # from_hf(...), preset(name), to_hf(), to_dict()
    model_class: type                # (config, *, layers, first, last, experts, seed) -> chunk
    shapes: Callable                 # config -> core.costs.shapes.ModelShapes
    model_types: tuple = ()          # Hugging Face model_type values this family reads
    presets: tuple = ()              # preset names (config_class.preset)
    description: str = ""
    image_processor: type | None = None  # from_pretrained(folder, token_id), from_settings(...),
    #                                      TYPE_NAMES: the image_processor_type values it reads

    def preset(self, name: str):
        return self.config_class.preset(name)

    def build(self, config, **kwargs):
        return self.model_class(config, **kwargs)


_SPECS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Add a family; a preset name or model_type another family already has is an error."""
    for other in _SPECS.values():
        if other.family == spec.family:
            if other is spec or other == spec:
                return spec
            raise ValueError(f"model family {spec.family!r} is registered twice")
        clash = (set(other.presets) & set(spec.presets)) | (set(other.model_types) & set(spec.model_types))
        if clash:
            raise ValueError(f"model family {spec.family!r}: {sorted(clash)} already belong to "
                             f"{other.family!r}")
    _SPECS[spec.family] = spec
    return spec


def _load_built_in() -> None:
    """Register the built-in families not yet registered (a family registered first, such as a
    ``--model-module`` imported before any lookup, does not hide them)."""
    for module in BUILT_IN:
        s = importlib.import_module(module).SPEC
        if s.family not in _SPECS:
            register(s)


def import_model_module(name: str | None) -> None:
    """Import ``--model-module`` (it calls ``register``). Anything that goes wrong is a one-line
    ``ValueError`` naming the module: a name that does not import, a syntax error (its file and
    line), and any exception the module raises while it runs (where, in its file)."""
    if not name:
        return
    try:
        importlib.import_module(name)
    except SyntaxError as e:  # IndentationError and TabError included
        raise ValueError(f"--model-module {name!r}: {e.filename}, line {e.lineno}: "
                         f"{type(e).__name__}: {e.msg}") from None
    except ImportError as e:
        raise ValueError(f"--model-module {name!r}: cannot import it ({e})") from None
    except Exception as e:  # the module's own code raised while it was imported
        raise ValueError(f"--model-module {name!r} raised {type(e).__name__} while it was imported"
                         f"{_where(name, e)}: {e}") from None


def _where(name: str, e: BaseException) -> str:
    """', at FILE, line N' of the innermost frame in the module's own file (else the innermost)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    try:
        origin = importlib.util.find_spec(name).origin
    except (ImportError, AttributeError, ValueError):
        origin = None
    own = [f for f in frames if origin and f.filename == origin] or frames[-1:]
    return f", at {own[-1].filename}, line {own[-1].lineno}" if own else ""


def families() -> dict[str, ModelSpec]:
    _load_built_in()
    return dict(_SPECS)


def spec(family: str) -> ModelSpec:
    specs = families()
    if family not in specs:
        raise ValueError(f"unknown model family {family!r}; registered: {', '.join(sorted(specs))}")
    return specs[family]


def preset_names() -> list[str]:
    return sorted(p for s in families().values() for p in s.presets)


def spec_for_preset(name: str) -> ModelSpec:
    for s in families().values():
        if name in s.presets:
            return s
    raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(preset_names())}")


def spec_of(config) -> ModelSpec:
    """The family of a config object (by its class)."""
    for s in families().values():
        if isinstance(config, s.config_class):
            return s
    raise ValueError(f"{type(config).__name__} is not the config of a registered model family")


def _model_type(raw: dict) -> str | None:
    text = raw.get("text_config")
    return raw.get("model_type") or (text.get("model_type") if isinstance(text, dict) else None)


def spec_for_hf(path_or_dict) -> ModelSpec:
    """The family whose ``model_type`` a Hugging Face config (dict, file or directory) names."""
    raw = read_hf_config(path_or_dict)
    kind = _model_type(raw)
    for s in families().values():
        if kind in s.model_types or (isinstance(raw.get("text_config"), dict)
                                     and _model_type(raw["text_config"]) in s.model_types):
            return s
    known = sorted(t for s in families().values() for t in s.model_types)
    where = path_or_dict if isinstance(path_or_dict, str) else "config"
    raise ValueError(f"{where}: model_type {kind!r} is not a registered model family's "
                     f"(known: {', '.join(known)})")


def read_hf_config(path_or_dict) -> dict:
    if isinstance(path_or_dict, dict):
        return path_or_dict
    path = os.path.join(path_or_dict, "config.json") if os.path.isdir(path_or_dict) else path_or_dict
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def resolve(preset: str | None = None, hf_config=None, **overrides):
    """``(spec, config)`` from a Hugging Face config (wins) or a preset; ``overrides``: config
    fields that say how to compute (``attention_backend``)."""
    s = spec_for_hf(hf_config) if hf_config else spec_for_preset(preset)
    base = s.config_class.from_hf(hf_config).to_hf() if hf_config else s.preset(preset).to_hf()
    return s, s.config_class.from_hf(base, **overrides)


def _image_processor_class(kind, where: str) -> type:
    """The image processor class of the family whose ``TYPE_NAMES`` hold ``kind``."""
    owners = {name: s.image_processor for s in families().values() if s.image_processor is not None
              for name in s.image_processor.TYPE_NAMES}
    if kind in owners:
        return owners[kind]
    raise ValueError(f"{where}: image_processor_type {kind!r} is not a registered model family's "
                     f"(known: {', '.join(sorted(owners)) or 'none'})")


def load_image_processor(folder: str, token_id: Callable[[str], int]):
    """The image processor of a processor folder (its ``image_processor_type`` picks the family);
    ``token_id``: the tokenizer's token -> id, for the image special tokens."""
    from models.common.processor_files import read_image_processor_config

    raw, where = read_image_processor_config(folder)
    cls = _image_processor_class(raw.get("image_processor_type"), where)
    return cls.from_pretrained(folder, token_id)


def image_processor_from_settings(settings: dict, token_ids: dict):
    """Rebuild an image processor from its ``settings`` and ``token_ids`` (what a dataset stores)."""
    cls = _image_processor_class(settings.get("image_processor_type"), "image processor settings")
    return cls.from_settings(settings, token_ids)


_SHAPES: dict = {}


def shapes_of(config):
    """The family's :class:`~core.costs.shapes.ModelShapes` of ``config`` (cached per config)."""
    key = (type(config).__name__, repr(config))
    if key not in _SHAPES:
        _SHAPES[key] = spec_of(config).shapes(config)
    return _SHAPES[key]

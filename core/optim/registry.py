"""Optimizers for matrices, as a registry: each declares how it is built, its state bytes per
parameter, its step's cost for the time model, and what it refuses. ``--optimizer`` takes any
registered name; validation (``core/memory_mode.py``), ``core/optim/build.py`` and the planner
(``training/planner/``) ask the declaration and nothing else.

Every optimizer here handles the *matrix* group (2-D matrices and 3-D expert stacks that are not
embeddings or heads, ``core/optim/build.classify``); embeddings, heads, norms and vectors always
go to AdamW. An optimizer registered with ``matrices=False`` (``adamw``) takes no matrix group:
everything goes to AdamW.

A new optimizer (a test registers SGD from the test tree) is one file: its flags (a dataclass of
``core.cli.option`` fields, added to the training flags while it is registered) and one
``register(OptimizerSpec(...))`` call, made before the flags are parsed (``--model-module`` may
make it):

    @dataclass
    class SGDFlags:
        sgd_momentum: float = option(0.0, "SGD momentum (0: no buffer)")

    register(OptimizerSpec("sgd", flags=SGDFlags,
                           build=lambda groups, cfg, masters: torch.optim.SGD(groups, lr=cfg.lr,
                                                                              momentum=cfg.sgd_momentum),
                           state_bytes=lambda shape, numel, opts: 4 * numel if opts.sgd_momentum else 0,
                           step_flops=lambda shape, opts: 0.0, step_bytes=lambda opts: 12,
                           refuses={"remainders": "it updates the parameters in their own dtype"}))

Its declarations read ``opts``: the optimizer's declared options (``options``, the shared
optimizer flags it reads, and its own ``flags``) as attributes: ``OptimOptions`` in the planner
(``PlanInputs.optim``), the parsed ``OptimArgs`` in the trainer.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

# features an optimizer may refuse, and the flags that select them (for the error message)
FEATURES = {
    "fsdp": "--data-parallel-sharding fsdp",
    "remainders": "--store-param-remainders",
    "host_masters": "--cpu-offload masters",
    "in_backward": "--optimizer-in-backward",
    "lora": "--lora-rank",
}
MASTER_BYTES = 4  # optimizer state is fp32


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer of the matrix group.

    ``build(param_groups, cfg, masters)``: the torch optimizer over the matrix groups (``cfg``: the
    optimizer flags, ``masters``: ``core/optim/masters.py``'s exact fp32 masters of bf16 parameters).
    ``state_bytes(shape, numel, opts)``: optimizer state bytes of one parameter of that (whole) shape
    whose shard on this rank has ``numel`` elements. ``step_flops(shape, opts)``: FLOPs of one step
    of a whole parameter of that shape (beyond the elementwise update). ``step_bytes(opts)``: device
    memory bytes read and written per parameter by the elementwise update. ``refuses``: feature
    (``FEATURES``) -> why. ``in_backward(opts)``: ``None`` when it can step inside the backward with
    these options, else why not (refused outright when ``"in_backward"`` is in ``refuses``).
    ``splits_row_shards``: the time model deals row-sharded matrices out to owners
    (``core/optim/muon_split.py``) instead of ``step_flops`` on every rank.
    ``options``: the shared optimizer flags (``OptimArgs`` fields) its declarations read;
    ``flags``: a dataclass of flags of its own (``core.cli.option`` fields, named for the
    optimizer), parsed into the optimizer section while it is registered.
    ``opts`` is anything with the declared options as attributes (``OptimArgs``, ``OptimOptions``)."""

    name: str
    build: Callable | None = None
    state_bytes: Callable = lambda shape, numel, opts: 0
    step_flops: Callable = lambda shape, opts: 0.0
    step_bytes: Callable = lambda opts: 12
    refuses: dict = field(default_factory=dict)
    in_backward: Callable | None = None
    matrices: bool = True
    splits_row_shards: bool = False
    options: tuple = ()
    flags: type | None = None

    def option_names(self) -> tuple:
        """Every option its declarations read: the shared ones, then its own flags."""
        return self.options + tuple(f.name for f in dataclasses.fields(self.flags)) if self.flags else self.options

    def flag_defaults(self) -> dict:
        """Its own flags' defaults."""
        return {f.name: f.default for f in dataclasses.fields(self.flags)} if self.flags else {}

    def refusal(self, feature: str, opts=None) -> str | None:
        """Why this optimizer cannot serve ``feature`` (with these options), or None."""
        if feature == "in_backward":
            if feature in self.refuses or self.in_backward is None:
                why = self.refuses.get(feature, f"is not supported by --optimizer {self.name}")
                return f"--optimizer-in-backward {why} (got {self.name})"
            why = self.in_backward(opts)
            return None if why is None else f"--optimizer-in-backward {why}"
        if feature in self.refuses:
            return (f"--optimizer {self.name} with {FEATURES[feature]} is not supported: "
                    f"{self.refuses[feature]}")
        return None


@dataclass(frozen=True)
class OptimOptions:
    """An optimizer and the values of the options it declares (``OptimizerSpec.option_names``),
    readable as attributes: what the planner holds (``PlanInputs.optim``) and passes to the
    declarations as ``opts``. Hashable (the planner caches per optimizer and options)."""

    optimizer: str
    values: tuple = ()  # (name, value) pairs in the declaration's order

    @classmethod
    def of(cls, optimizer: str, source=None, defaults: dict | None = None) -> "OptimOptions":
        """The declared options of ``optimizer``, each read from ``source`` (e.g. ``OptimArgs``),
        else from ``defaults``, else the optimizer's own flag default."""
        spec, defaults = get(optimizer), {**get(optimizer).flag_defaults(), **(defaults or {})}
        values = []
        for name in spec.option_names():
            if hasattr(source, name):
                values.append((name, getattr(source, name)))
            elif name in defaults:
                values.append((name, defaults[name]))
            else:
                raise ValueError(f"--optimizer {optimizer}: no value for its option --{name.replace('_', '-')}")
        return cls(optimizer, tuple(values))

    @property
    def spec(self) -> OptimizerSpec:
        return get(self.optimizer)

    def as_dict(self) -> dict:
        return dict(self.values)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "values":
            raise AttributeError(name)
        for k, v in self.values:
            if k == name:
                return v
        raise AttributeError(f"--optimizer {self.optimizer} declares no option {name!r}")


_REGISTRY: dict[str, OptimizerSpec] = {}


def register(spec: OptimizerSpec) -> OptimizerSpec:
    """Add (or replace) an optimizer under ``spec.name``; returns it."""
    _REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> OptimizerSpec:
    if name not in _REGISTRY:
        raise ValueError(f"--optimizer {name!r}: expected one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def names() -> list[str]:
    return list(_REGISTRY)


def with_flags() -> list[OptimizerSpec]:
    """The registered optimizers that bring flags of their own."""
    return [s for s in _REGISTRY.values() if s.flags is not None]


def add_flags(parser) -> None:
    """Each registered optimizer's own flags, in a group of its own (``--help`` lists them)."""
    from core.cli import add_to_parser

    for spec in with_flags():
        add_to_parser(parser, spec.flags, f"optimizer {spec.name}")


def flag_values(ns) -> dict:
    """The registered optimizers' own flags from the parsed ``ns`` (their defaults where the parser
    was built before the registration); their dataclasses' checks raise ``ValueError``."""
    from core.cli import from_namespace

    out = {}
    for spec in with_flags():
        parsed = all(f.name in ns for f in dataclasses.fields(spec.flags))
        out.update(vars(from_namespace(spec.flags, ns)) if parsed else spec.flag_defaults())
    return out


class Registered:
    """``choices`` for argparse that follows the registry (an optimizer registered after the
    parser was built is still accepted and listed)."""

    def __contains__(self, name) -> bool:
        return name in _REGISTRY

    def __iter__(self):
        return iter(list(_REGISTRY))


# ------------------------------------------------------------------------ the built-in three


def _build_muon(groups, cfg, masters):
    import torch

    from core.optim.muon import Muon

    ns_dtype = torch.float32 if getattr(cfg, "muon_ns_dtype", "bf16") == "fp32" else torch.bfloat16
    return Muon(groups, lr=cfg.lr, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                weight_decay=cfg.weight_decay, ns_steps=cfg.muon_ns_steps, ns_method=cfg.muon_ns_method,
                lr_adjust=cfg.muon_lr_adjust, ns_dtype=ns_dtype, masters=masters)


def _muon_flops(shape, opts) -> float:
    from core.optim.muon_split import ns_flops

    return ns_flops(tuple(shape), opts.muon_ns_steps)


def _muon_in_backward(opts) -> str | None:
    momentum, clip = opts.muon_momentum, getattr(opts, "clip_grad", 0.0)
    if momentum > 0 and clip > 0:
        return (f"with --clip-grad {clip:g} needs --muon-momentum 0: the clip factor is known only after "
                "the backward, and only momentum-free Muon is unchanged by it (or pass --clip-grad 0)")
    return None


def _build_dion(groups, cfg, masters):
    from core.optim.dion import Dion

    return Dion(groups, lr=cfg.lr, momentum=cfg.dion_momentum, rank_fraction=cfg.dion_rank_fraction,
                weight_decay=cfg.weight_decay)


def _dion_rank(shape, opts) -> int:
    m, n = shape[-2], shape[-1]
    return max(1, math.ceil(opts.dion_rank_fraction * min(m, n)))


def _dion_state(shape, numel, opts) -> int:
    """The momentum / error-feedback buffer (this rank's shard) and the n x r right factor of
    every matrix of the stack."""
    batch = math.prod(shape) // (shape[-2] * shape[-1])
    return numel * MASTER_BYTES + batch * shape[-1] * _dion_rank(shape, opts) * MASTER_BYTES


def _dion_flops(shape, opts) -> float:
    m, n = sorted(shape[-2:])
    batch = math.prod(shape) // (shape[-2] * shape[-1])
    return batch * 8.0 * m * n * max(1, math.ceil(opts.dion_rank_fraction * m))


NOT_MUON = "steps Muon's matrices: it needs --optimizer muon"

register(OptimizerSpec("adamw", matrices=False, refuses={"in_backward": NOT_MUON}))
register(OptimizerSpec(
    "muon", build=_build_muon,
    state_bytes=lambda shape, numel, opts: numel * MASTER_BYTES if opts.muon_momentum > 0 else 0,
    step_flops=_muon_flops,
    # p read and written (decay, update), the update read; a momentum buffer adds 12
    step_bytes=lambda opts: 12 + 12 * (opts.muon_momentum > 0),
    in_backward=_muon_in_backward, splits_row_shards=True, options=("muon_momentum", "muon_ns_steps", "clip_grad"),
    refuses={"lora": "LoRA adapters train with AdamW (the frozen base has nothing for Muon to step): use "
                     "--optimizer adamw"}))
register(OptimizerSpec(
    "dion", build=_build_dion, state_bytes=_dion_state, step_flops=_dion_flops,
    step_bytes=lambda opts: 24, options=("dion_rank_fraction",),
    refuses={"fsdp": "its power iteration needs whole matrices (sharded Dion is not built yet): use muon or "
                     "adamw",
             "remainders": "it updates bf16 parameters without their fp32 masters: use muon or adamw",
             "host_masters": "its state is not kept on the host: use muon or adamw",
             "in_backward": NOT_MUON,
             "lora": "LoRA adapters train with AdamW (the frozen base has nothing for Dion to step): use "
                     "--optimizer adamw"}))


def unregister(name: str) -> None:
    """Remove a registered optimizer (tests that register their own put the registry back)."""
    _REGISTRY.pop(name, None)

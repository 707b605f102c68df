"""What the planner plans (:class:`PlanInputs`): the layout, the batch, the training flags' memory
section itself (``mode``: ``core/memory_mode.MemoryMode``) and the optimizer with its declared
options (``optim``: ``core/optim/registry.OptimOptions``), and what the memory and time models
derive from them. ``run.plan_inputs`` builds it from the parsed training flags; the search
replaces its layout and mode (``dataclasses.replace``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

from core.finetune.lora import DEFAULT_TARGETS
from core.memory_mode import MemoryMode, RecomputePlacement, RunFacts
from core.optim.registry import OptimOptions
from core.parallel_state import ParallelSizes
from training.planner.vision import ImageMix

MASTER = 4  # parameters (the fp32 master under bf16), gradients and optimizer state
# the shared optimizer options where a plan gives none: stateless Muon (momentum 0, no optimizer
# memory); the others at their flags' defaults (train_args.OptimArgs)
OPTION_DEFAULTS = dict(muon_momentum=0.0, muon_ns_steps=5, dion_rank_fraction=0.25, clip_grad=1.0)
IMAGE_FIELDS = ("image_token_share", "image_crops_per_image", "freeze_vision")
LAYOUT = ("pp", "vpp", "ep", "dp", "cp")


def optim_options(optimizer: str = "muon", **options) -> OptimOptions:
    """``optimizer`` (a registered name: the registry's error otherwise) with ``options`` (its
    declared ones, by their flag names), the rest at ``OPTION_DEFAULTS`` or its own flags' defaults."""
    return OptimOptions.of(optimizer, SimpleNamespace(**options), defaults=OPTION_DEFAULTS)


@dataclass
class PlanInputs:
    """The layout, the batch, the memory mode and the optimizer of one plan."""

    pp: int = 1
    vpp: int = 1
    ep: int = 1
    dp: int = 1
    cp: int = 1                     # context-parallel ranks per pack (DP is the rest)
    mode: MemoryMode = field(default_factory=MemoryMode)  # the memory flags (core/memory_mode.py)
    optim: OptimOptions = field(default_factory=optim_options)  # the optimizer and its options
    seq_length: int = 8192
    micro_batch_size: int = 1
    num_microbatches: int = 8       # per pipeline per iteration
    device_gb: float = 141.0
    pipeline_layout: str | None = None
    moe_dispatcher: str = "alltoall"      # alltoall | allgather (the time model's overlap)
    overlap_moe_expert_parallel_comm: bool = False  # two chunks, all-to-alls behind compute (overlap.py)
    compile: bool = False                 # (--compile refuses chunked recompute)
    lora_rank: int = 0                    # LoRA: adapters of this rank on a frozen base (core/finetune/lora.py)
    lora_targets: str = DEFAULT_TARGETS   # what they adapt (--lora-targets)
    image_token_share: float = 0.0        # images in the packs (training/planner/vision.py; 0: text only)
    image_crops_per_image: float = 0.0
    freeze_vision: bool = False

    def __post_init__(self):
        # the flags' own rules and the chunks' cut (core/memory_mode.py); the rest of the layout's
        # rules are the search's and validation's (MemoryMode.check over run_facts)
        self.mode.check_chunks(self.micro_batch_size)
        ImageMix(self.image_token_share, self.image_crops_per_image, self.freeze_vision)  # its flags' rules
        if self.cp > 1 and self.seq_length % (2 * self.cp):
            raise ValueError(f"--seq-length {self.seq_length} must be a multiple of 2 x --context-parallel-size "
                             f"= {2 * self.cp}")

    def as_json(self) -> dict:
        """The inputs as JSON, flat, under the flags' names: the layout, the memory flags, the
        optimizer and its declared options, the rest; a text-only plan without the image fields."""
        rest = [f.name for f in dataclasses.fields(self) if f.name not in (*LAYOUT, "mode", "optim")]
        out = {**{k: getattr(self, k) for k in LAYOUT}, **dataclasses.asdict(self.mode),
               "optimizer": self.optim.optimizer, **self.optim.as_dict(), **{k: getattr(self, k) for k in rest}}
        return {k: v for k, v in out.items() if self.image_token_share or k not in IMAGE_FIELDS}

    @property
    def recompute_placement(self) -> RecomputePlacement:
        """Which blocks recompute what (the mode's placement, as ``apply_recompute`` sets it)."""
        return self.mode.recompute_placement

    @property
    def run_facts(self) -> RunFacts:
        """What the mode is checked against (``MemoryMode.check``): as validation builds it."""
        return RunFacts.of(self.dp, self.cp, self.num_microbatches, self.micro_batch_size, self.optim,
                           compile=self.compile, lora=self.lora_rank > 0)

    @property
    def lora(self) -> tuple:
        """``rank_shares``' LoRA key: ``(rank, targets)``, or empty without LoRA."""
        return (self.lora_rank, self.lora_targets) if self.lora_rank else ()

    @property
    def optimizer_spec(self):
        return self.optim.spec

    @property
    def bf16_params(self) -> bool:
        """Parameters stored in bf16 (remainders, or host masters): their gradients are bf16."""
        return self.mode.bf16_params

    @property
    def grad_bytes(self) -> int:
        """Bytes per parameter of a sharded gradient: fp32, or bf16 (rounded once after an fp32
        reduction) for bf16-stored parameters."""
        return 2 if self.bf16_params else MASTER

    @property
    def sizes(self) -> ParallelSizes:
        return ParallelSizes(self.pp * self.dp * self.cp, pp=self.pp, ep=self.ep, vpp=self.vpp, cp=self.cp)

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch (T)."""
        return self.seq_length * self.micro_batch_size

    @property
    def local_tokens(self) -> int:
        """Tokens of a micro-batch on one rank: its CP shard, ``T / cp``."""
        return self.tokens // self.cp

    @property
    def chunk_tokens(self) -> int:
        """Tokens a recomputed block's backward holds at once: its chunk's (``--recompute-chunks``)."""
        return self.local_tokens // self.recompute_placement.chunks

    @property
    def act_bytes(self) -> int:
        return self.mode.activation_bytes

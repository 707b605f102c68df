"""Memory modes: one table of the memory flags (precision, master storage, sharding, CPU offload,
activation recompute), the rules of which combinations run, and where each kind of parameter's
tensors live under a mode. The training flags' memory section is generated from
:class:`MemoryMode`; validation (``train_args.validate``), ``parallelize`` / FSDP wrapping
(``core/distributed/fsdp.py``), the memory and time models and the layout search
(``training/planner/``) all read it, and no other module compares the flags' values.

A new memory mode is a field here, its rule in :meth:`MemoryMode.check_flags` (the flags alone) or
:meth:`MemoryMode.check` (against the run's layout and optimizer), and what it changes in
:meth:`MemoryMode.placement`; the search enumerates modes and keeps those ``check`` accepts.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from core.cli import option
from core.optim import registry as optimizers
from core.parallel_state import ParallelSizes

SHARDING_MODES = ("none", "fsdp")
OFFLOAD_MODES = ("none", "all", "experts", "optimizer", "masters")
RECOMPUTE_MODES = ("none", "selective", "full")
KINDS = ("dense", "expert")  # parameters replicated over DP x CP, routed experts over expert-DP


@dataclass
class MemoryMode:
    """Memory: precision, master storage, sharding, offload and activation recompute."""

    bf16: bool = option(False, "bf16 compute over fp32 master weights: fp32 gradient accumulation "
                               "and reduction (FSDP2 mixed precision; without --data-parallel-sharding "
                               "on one-rank meshes); routers, RoPE, norm and softmax statistics and "
                               "the loss stay fp32")
    data_parallel_sharding: str = option("none", "fsdp: FSDP2-shard dense parameters over the DP ranks "
                                                 "and experts over the expert-DP ranks",
                                         choices=("none", "fsdp"))
    cpu_offload: str = option("none", "host memory for FSDP shards: all (every shard, its gradient and "
                                      "optimizer state; copied to the device for each micro-batch's "
                                      "forward and backward), experts (only the experts'), optimizer "
                                      "(fp32 masters, gradients and optimizer state on the host, the "
                                      "compute copies resident on the device for the whole step: one "
                                      "copy per step; gradients reduced and sent to the host after "
                                      "every micro-batch), masters (with --bf16: bf16 weights are the "
                                      "only copy on the device; fp32 masters and optimizer state on the "
                                      "host, updated by host threads while the backward goes on; each "
                                      "finished update goes to the host once, the new bf16 weights come "
                                      "back once per step; one micro-batch per rank and step)",
                                choices=("none", "all", "experts", "optimizer", "masters"))
    fsdp_gather_once: bool = option(False, "with fsdp: gather each stage's parameters once per step "
                                           "and keep them until the optimizer step (fewer all-gathers, "
                                           "the memory of an unsharded stage)")
    store_param_remainders: bool = option(False, "with --bf16: hold each parameter as its bf16 compute value "
                                                 "plus a 16-bit remainder, which together are its fp32 master "
                                                 "bit for bit (4 bytes per parameter instead of 4 + a 2-byte "
                                                 "bf16 copy); the optimizer updates the fp32 value and splits it "
                                                 "again, checkpoints hold the fp32 masters")
    optimizer_in_backward: bool = option(False, "Muon's matrices step inside the backward, each as soon as its "
                                                "gradient is final, and free that gradient at once (no "
                                                "whole-model gradient buffer); needs one micro-batch per rank "
                                                "and step, --optimizer muon and, with clipping, "
                                                "--muon-momentum 0 (momentum-free Muon ignores a global "
                                                "gradient scale, so clipping cannot change its updates; the "
                                                "AdamW groups step after the backward, clipped as always)")
    recompute_granularity: str = option("none", "activation recompute: whole layers (full) or "
                                                "attention and FFN internals (selective), and the "
                                                "MTP depths up to their heads when every layer of "
                                                "the chunk is recomputed",
                                        choices=("none", "selective", "full"))
    recompute_num_layers: int = option(0, "recompute only the first N layers of each chunk (0: all, "
                                          "and the MTP depths)")
    recompute_chunks: int = option(1, "with full recompute: each recomputed layer and MTP depth runs its "
                                      "forward, and later its rerun and backward, N chunks of the "
                                      "micro-batch at a time (groups of whole packs: N must divide "
                                      "--micro-batch-size), its gradients summed "
                                      "over the chunks before they are reduced: the backward's working set "
                                      "and all-to-all buffers of one chunk, one layer's gradients at a "
                                      "time, so --optimizer-in-backward and --cpu-offload masters serve "
                                      "several packs per rank (core/transformer/chunked.py)")
    offload_recompute_inputs: bool = option(False, "with full recompute: the input each recomputed layer "
                                                   "keeps for its backward waits in pinned host memory "
                                                   "(copied out on a stream of its own, back when the "
                                                   "layer's backward starts)")
    def __post_init__(self):
        self.check_flags()

    # ------------------------------------------------------------------------------------- rules

    def check_flags(self) -> None:
        """``ValueError`` naming the flags for a combination that never runs, whatever the layout."""
        for name, allowed in (("data_parallel_sharding", SHARDING_MODES), ("cpu_offload", OFFLOAD_MODES),
                              ("recompute_granularity", RECOMPUTE_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: expected one of "
                                 f"{', '.join(allowed)}")
        for name, least in (("recompute_num_layers", 0), ("recompute_chunks", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(self, name)}")
        if self.recompute_num_layers and self.recompute_granularity == "none":
            raise ValueError("--recompute-num-layers needs --recompute-granularity selective or full")
        for flag, on in (("--recompute-chunks", self.recompute_chunks > 1),
                         ("--offload-recompute-inputs", self.offload_recompute_inputs)):
            if on and self.recompute_granularity != "full":
                raise ValueError(f"{flag} needs --recompute-granularity full (it runs the recomputed layers)")
        if self.cpu_offload not in ("none", "masters") and self.data_parallel_sharding != "fsdp":
            raise ValueError("--cpu-offload needs --data-parallel-sharding fsdp")
        if self.host_masters and not self.bf16:
            raise ValueError("--cpu-offload masters needs --bf16 (the device holds the bf16 compute weights)")
        if self.store_param_remainders and not self.bf16:
            raise ValueError("--store-param-remainders needs --bf16 (it stores bf16 compute values)")
        if self.store_param_remainders and self.cpu_offload != "none":
            raise ValueError("--store-param-remainders with --cpu-offload is not supported: offload keeps "
                             "fp32 masters in host memory already")

    def check(self, run: "RunFacts") -> None:
        """``ValueError`` naming the flags for what this mode cannot serve in ``run`` (the layout,
        the optimizer and its options): the one set of rules validation and the search share."""
        self.check_flags()
        M, replicas, n = run.num_microbatches, run.dense_replicas, self.recompute_chunks
        self.check_chunks(run.micro_batch_size)
        if n > 1 and run.context_parallel > 1:
            raise ValueError("--recompute-chunks with --context-parallel-size > 1 is not supported: a CP shard's "
                             "documents are cut by the shard, not at its boundaries")
        if run.compile and (n > 1 or self.offload_recompute_inputs):
            raise ValueError("--compile with --recompute-chunks or --offload-recompute-inputs is not supported: "
                             "the chunked recompute runs each layer's chunks eagerly around its FSDP hooks")
        if self.host_masters:
            if M != 1:
                raise ValueError(f"--cpu-offload masters needs one micro-batch per rank and step, got {M}: set "
                                 "--global-batch-size to --micro-batch-size x data-parallel size")
            if replicas > 1 and self.data_parallel_sharding != "fsdp":
                raise ValueError("--cpu-offload masters with dense replicas (data-parallel x context-parallel "
                                 "size > 1) needs --data-parallel-sharding fsdp")
        opt = optimizers.get(run.optimizer)
        for feature, on in (("fsdp", self.data_parallel_sharding == "fsdp"),
                            ("remainders", self.store_param_remainders), ("host_masters", self.host_masters),
                            ("in_backward", self.optimizer_in_backward)):
            why = opt.refusal(feature, run.optimizer_options) if on else None
            if why:
                raise ValueError(why)
        if self.optimizer_in_backward:
            if M != 1:
                raise ValueError(f"--optimizer-in-backward needs one micro-batch per rank and step, got {M}: "
                                 "set --global-batch-size to --micro-batch-size x data-parallel size")
            if replicas > 1 and self.data_parallel_sharding != "fsdp":
                raise ValueError("--optimizer-in-backward with dense replicas (data-parallel x context-parallel "
                                 "size > 1) needs --data-parallel-sharding fsdp: each unit's gradients are "
                                 "reduced when its backward ends, then stepped")
            if self.cpu_offload not in ("none", "masters"):
                raise ValueError(f"--optimizer-in-backward with --cpu-offload {self.cpu_offload} is not supported "
                                 "(--cpu-offload masters is: its host updates overlap the backward)")
        if run.lora:
            self.check_lora(run)

    def check_lora(self, run: "RunFacts") -> None:
        """LoRA (``--lora-rank``): a frozen base has no masters, gradients or optimizer state, and
        the adapters train in fp32 with AdamW; what that does not compose with."""
        why = optimizers.get(run.optimizer).refusal("lora", run.optimizer_options)
        if why:
            raise ValueError(why)
        for flag, on, reason in (
                ("--store-param-remainders", self.store_param_remainders, "the frozen base has no fp32 masters to "
                 "store and the adapters train in fp32"),
                ("--cpu-offload masters", self.host_masters, "the frozen base has no masters and the adapters' "
                 "optimizer state is small"),
                ("--cpu-offload optimizer", self.cpu_offload == "optimizer", "it keeps compute copies resident "
                 "and moves optimizer state the frozen base does not have: use --cpu-offload experts or all"),
                ("--optimizer-in-backward", self.optimizer_in_backward, "the adapters step with AdamW after the "
                 "backward"),
                ("--recompute-chunks", self.recompute_chunks > 1, "not planned or tested across ranks yet "
                 "(the planner books the frozen base's chunk sums; the adapters' gradients are tested at one process)"),
                ("--offload-recompute-inputs", self.offload_recompute_inputs, "not planned or tested across ranks "
                 "yet (the planner books the frozen base's chunk sums; the adapters' gradients are tested at one "
                 "process)")):
            if on:
                raise ValueError(f"--lora-rank with {flag} is not supported: {reason}")

    def check_chunks(self, micro_batch_size: int) -> None:
        """``--recompute-chunks`` cuts a micro-batch into groups of whole packs."""
        n = self.recompute_chunks
        if n > 1 and micro_batch_size % n:
            raise ValueError(f"--recompute-chunks {n} must divide --micro-batch-size {micro_batch_size}: "
                             "each chunk is a group of whole packs")

    def allows(self, run: "RunFacts") -> bool:
        try:
            self.check(run)
        except ValueError:
            return False
        return True

    # ---------------------------------------------------------------------------- what it means

    def runs_like_another(self, dense_replicas: int) -> bool:
        """Runs exactly like another mode (the search lists only that one): gather-once without
        sharding (units on one-rank meshes are gathered once anyway) or with ``--cpu-offload
        optimizer`` (which gathers once); with one dense replica nothing shards, so fsdp without
        FSDP's offload (or with gather-once) is the plain mode, and offload puts units on one-rank
        meshes gathered once per step."""
        fsdp = self.data_parallel_sharding == "fsdp"
        if self.fsdp_gather_once and (not fsdp or self.cpu_offload == "optimizer"):
            return True
        return dense_replicas == 1 and fsdp and (self.fsdp_offload == "none" or self.fsdp_gather_once)

    @property
    def host_masters(self) -> bool:
        """fp32 masters and optimizer state on the host, bf16 weights the only device copy."""
        return self.cpu_offload == "masters"

    @property
    def fsdp_offload(self) -> str:
        """The offload FSDP itself does (``none`` for host masters, which FSDP does not see)."""
        return "none" if self.host_masters else self.cpu_offload

    @property
    def bf16_params(self) -> bool:
        """Parameters stored in bf16 (remainders, or host masters): their gradients are bf16."""
        return self.store_param_remainders or self.host_masters

    @property
    def uses_host_threads(self) -> bool:
        """The optimizer step (or part of it) runs on the host: the rank needs its share of cores."""
        return self.cpu_offload != "none"

    def placement(self, sizes: ParallelSizes, num_microbatches: int, lora: bool = False) -> "Placement":
        """Where each kind of parameter lives under this mode for a layout (``sizes``) running
        ``num_microbatches`` per rank and step: what ``core/distributed/fsdp.apply_fsdp`` does and
        what the planner books. Nothing to shard at one dense replica; without sharding, ``bf16``
        or CPU offload still put every unit on a one-rank mesh (gathered once per step), except
        that bf16-stored parameters at one micro-batch need no mesh; experts whole on each EP rank
        (expert-DP 1) are left out of FSDP unless offloaded or under ``bf16``;
        ``cpu_offload="optimizer"`` offloads every unit, gathers once per step and reduces on
        every backward. ``lora``: the base is frozen (``Placement.frozen``: per kind, the base's
        one stored copy, with no master, gradient or optimizer state; the adapters are placed
        as ``roles`` say)."""
        replicas = sizes.dp * sizes.cp
        shard = self.data_parallel_sharding == "fsdp" and replicas > 1
        off = self.fsdp_offload
        one_rank = self.bf16 and not (self.bf16_params and num_microbatches == 1)
        self_meshes = one_rank or off != "none"
        managed = {"dense": shard or self_meshes,
                   "expert": (sizes.expert_dp > 1 or self_meshes) if shard else self_meshes}
        offload = {"dense": off in ("all", "optimizer"), "expert": off != "none"}
        world = {"dense": replicas if shard else 1,
                 "expert": sizes.expert_dp if shard and managed["expert"] else 1}
        resident = off == "optimizer"
        gather_once = self.fsdp_gather_once or resident or not shard
        roles = {}
        for k in KINDS:
            on_host = managed[k] and offload[k]
            roles[k] = RolePlacement(
                kind=k, managed=managed[k], shard_world=world[k], offloaded=on_host,
                compute_dtype="bf16" if self.bf16 else "fp32",
                master="host" if on_host or self.host_masters else "device",
                master_dtype="bf16+remainder" if self.store_param_remainders else "fp32",
                gradient="host" if on_host else "device",
                gradient_dtype="bf16" if self.bf16_params else "fp32",
                optimizer_state="host" if on_host or self.host_masters else "device",
                gathered=("whole" if not managed[k] else "once per step" if gather_once
                          else "per micro-batch and pass"))
        frozen = {k: dataclasses.replace(r, master="none", master_dtype="bf16" if self.bf16 else "fp32", gradient="none", gradient_dtype="none",
                                         optimizer_state="none") for k, r in roles.items()} if lora else {}
        return Placement(roles=roles, frozen=frozen, shard=shard, self_meshes=self_meshes, gather_once=gather_once,
                         sync_every_microbatch=resident, host_masters=self.host_masters,
                         remainders=self.store_param_remainders, bf16=self.bf16, pin_offloaded=not resident,
                         recompute_placement=self.recompute_placement, in_backward=self.optimizer_in_backward)

    @property
    def recompute_placement(self) -> "RecomputePlacement":
        """Which blocks recompute what (``Placement.recompute_placement``): what ``apply_recompute`` sets on
        the blocks and the planner books."""
        return RecomputePlacement(self.recompute_granularity, self.recompute_num_layers, self.recompute_chunks,
                                  self.offload_recompute_inputs)

    @property
    def compute_dtype(self) -> str:
        """The dtype the layers compute in (and activations, buffers and gathered copies take)."""
        return "bf16" if self.bf16 else "fp32"

    @property
    def activation_bytes(self) -> int:
        return 2 if self.bf16 else 4

    def flags(self, always: tuple = (), skip: tuple = ()) -> list[str]:
        """The command-line flags that select this mode: those off their default (and the fields
        in ``always``), in the table's order, less the fields in ``skip``."""
        out = []
        for f in dataclasses.fields(MemoryMode):
            value = getattr(self, f.name)
            if f.name in skip or (value == f.default and f.name not in always):
                continue
            flag = "--" + f.name.replace("_", "-")
            out.append(flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {value}")
        return out

    def short_words(self) -> tuple[str, str, str, str, str]:
        """The mode in the search table's columns: sharding, offload, gathered once (yes / no),
        recompute (full/4: --recompute-chunks 4; +off: --offload-recompute-inputs) and masters (fp32,
        or rem: --store-param-remainders; +ib: --optimizer-in-backward)."""
        chunks = f"/{self.recompute_chunks}" if self.recompute_chunks > 1 else ""
        recompute = self.recompute_granularity + chunks + ("+off" if self.offload_recompute_inputs else "")
        masters = ("rem" if self.store_param_remainders else "fp32") + ("+ib" if self.optimizer_in_backward else "")
        return (self.data_parallel_sharding, self.cpu_offload, "yes" if self.fsdp_gather_once else "no", recompute,
                masters)

    @classmethod
    def flag_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def of(cls, flags) -> "MemoryMode":
        """The mode of anything with the memory flags as attributes (the parsed memory section)."""
        return cls(**{name: getattr(flags, name) for name in cls.flag_names()})

    @classmethod
    def every(cls, **fixed) -> list["MemoryMode"]:
        """Every combination of the memory flags' discrete values (booleans, choices, and the
        numbers 0/1 for recompute layers and 1/2 for chunks) that ``check_flags`` accepts, with
        ``fixed`` fields held (a tuple: the values that field takes instead)."""
        values = {"bf16": (False, True), "store_param_remainders": (False, True),
                  "optimizer_in_backward": (False, True), "data_parallel_sharding": SHARDING_MODES,
                  "fsdp_gather_once": (False, True), "cpu_offload": OFFLOAD_MODES,
                  "recompute_granularity": RECOMPUTE_MODES, "recompute_num_layers": (0, 1),
                  "recompute_chunks": (1, 2), "offload_recompute_inputs": (False, True)}
        values.update({k: v if isinstance(v, tuple) else (v,) for k, v in fixed.items()})
        out = []
        for combo in itertools.product(*values.values()):
            try:
                out.append(cls(**dict(zip(values, combo))))
            except ValueError:
                pass
        return out


@dataclass(frozen=True)
class RunFacts:
    """What a mode is checked against: the layout and the optimizer (``optimizer_options``:
    anything with the optimizer flags as attributes, e.g. ``OptimArgs``; ``clip_grad`` included)."""

    dense_replicas: int = 1      # DP x CP: ranks holding copies of the dense parameters
    num_microbatches: int = 1    # per rank and step
    micro_batch_size: int = 1
    context_parallel: int = 1
    compile: bool = False
    optimizer: str = "adamw"
    optimizer_options: object = None
    lora: bool = False           # --lora-rank > 0: a frozen base with trained adapters (core/finetune/lora.py)

    @classmethod
    def of(cls, dp: int, cp: int, num_microbatches: int, micro_batch_size: int, optim, *, compile: bool = False,
           lora: bool = False) -> "RunFacts":
        """The one constructor: validation (``train_args.validate``) and the planner (each
        candidate of the search, ``PlanInputs.run_facts``) build what they check from the layout
        (``dp`` x ``cp`` ranks holding dense copies), the batch, and ``optim``: anything with the
        optimizer's name (``optimizer``) and its options as attributes (``OptimArgs``, the
        planner's ``OptimOptions``)."""
        return cls(dense_replicas=dp * cp, num_microbatches=num_microbatches, micro_batch_size=micro_batch_size,
                   context_parallel=cp, compile=compile, optimizer=optim.optimizer, optimizer_options=optim,
                   lora=lora)


@dataclass(frozen=True)
class RolePlacement:
    """One kind of parameter (dense or expert) under a mode: where its compute weight, master,
    gradient and optimizer state live and in which dtype, over how many ranks it is sharded, and
    when FSDP gathers it (routers compute in fp32 whatever ``compute_dtype`` says)."""

    kind: str
    managed: bool           # FSDP manages it (compute copies, unsharded gradients)
    shard_world: int        # ranks its shards split over (1: whole)
    offloaded: bool         # FSDP keeps its shard, gradient and optimizer state on the host
    compute_dtype: str      # of the weight the layers compute with (on the device)
    master: str             # where the master weight lives: device | host | none (a frozen LoRA base)
    master_dtype: str       # fp32, or bf16 + a 16-bit remainder (the same fp32 number); frozen: its stored copy
    gradient: str           # where its reduced gradient waits for the optimizer: device | host | none
    gradient_dtype: str
    optimizer_state: str    # device | host
    gathered: str           # whole (not FSDP's) | once per step | per micro-batch and pass


@dataclass(frozen=True)
class Placement:
    """A mode's placement for one layout (``MemoryMode.placement``); ``roles``: per kind."""

    roles: dict
    shard: bool                  # dense units sharded over DP x CP (experts over expert-DP)
    self_meshes: bool            # units on one-rank meshes where nothing shards (mixed precision, offload)
    gather_once: bool            # units keep their gathered weights until the optimizer step
    sync_every_microbatch: bool  # reduce-scatter on every backward (cpu_offload "optimizer")
    host_masters: bool           # cpu_offload "masters": fp32 masters on the host, bf16 on the device
    remainders: bool             # bf16 + 16-bit remainder storage
    bf16: bool                   # bf16 compute copies (FSDP mixed precision)
    pin_offloaded: bool          # offloaded shards in pinned memory (they cross PCIe per micro-batch)
    frozen: dict = dataclasses.field(default_factory=dict)  # LoRA: the frozen base per kind (RolePlacement)
    recompute_placement: "RecomputePlacement" = None  # which blocks recompute what (MemoryMode's)
    in_backward: bool = False    # matrices step inside the backward; their gradients are freed at once

    @property
    def wraps(self) -> bool:
        """FSDP wraps the chunk at all."""
        return self.shard or self.self_meshes

    @property
    def shard_world(self) -> dict:
        return {k: r.shard_world for k, r in self.roles.items()}

    @property
    def managed(self) -> dict:
        return {k: r.managed for k, r in self.roles.items()}

    @property
    def offloaded(self) -> dict:
        return {k: r.offloaded for k, r in self.roles.items()}

    @property
    def gather_per_microbatch(self) -> bool:
        """Managed units gathered for every forward and backward pass."""
        return not self.gather_once

    def copies_weights_per_microbatch(self) -> bool:
        """Host-to-device copies of offloaded shards on every forward and backward."""
        return self.gather_per_microbatch and any(self.offloaded.values())


@dataclass(frozen=True)
class RecomputePlacement:
    """Activation recompute under a mode: which blocks of a chunk recompute, at what granularity,
    in how many token chunks, with their kept inputs where. ``core/transformer/block.apply_recompute``
    sets it on the blocks; the planner's memory and time models book the same blocks.

    | granularity | a recomputed block keeps                | its backward holds again      |
    | none        | everything                              | nothing                       |
    | selective   | all but attention and FFN internals     | those internals, one at a time|
    | full        | its input (on the host: offload_inputs) | the whole block, a chunk at a time |
    """

    granularity: str = "none"   # none | selective | full
    num_layers: int = 0         # the first N decoder layers of each chunk (0: all, and the extra blocks)
    chunks: int = 1             # full: token chunks run one after another (core/transformer/chunked.py)
    offload_inputs: bool = False  # full: kept inputs in pinned host memory

    @property
    def on(self) -> bool:
        return self.granularity != "none"

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"

    @property
    def chunked(self) -> bool:
        """Full recompute a token chunk at a time (gradients summed over the chunks)."""
        return self.chunks > 1

    @property
    def runs_chunked(self) -> bool:
        """The block runs through ``chunked_recompute`` (token chunks, or inputs kept on the host)."""
        return self.chunks > 1 or self.offload_inputs

    def num_selected(self, chunk_layers: int) -> int:
        """How many of a chunk's ``chunk_layers`` decoder layers are selected (its first N)."""
        return min(self.num_layers, chunk_layers) if self.num_layers > 0 else chunk_layers

    def layer(self, k: int) -> str:
        """The granularity of a chunk's ``k``-th decoder layer."""
        return self.granularity if self.num_layers <= 0 or k < self.num_layers else "none"

    def recomputes_extra(self, chunk_layers: int) -> bool:
        """Whether the extra blocks after the chunk's layers (MTP depths) are selected: when all
        of its layers are."""
        return self.num_layers <= 0 or self.num_layers >= chunk_layers

    def extra(self, chunk_layers: int) -> str:
        """The granularity of the extra blocks of a chunk of ``chunk_layers`` decoder layers."""
        return self.granularity if self.recomputes_extra(chunk_layers) else "none"

    def block(self, granularity: str | None = None) -> "RecomputePlacement":
        """One block's setting (``granularity`` for it, default this one's): chunks and input
        offload only under full recompute."""
        g = self.granularity if granularity is None else granularity
        full = g == "full"
        return RecomputePlacement(g, 0, self.chunks if full else 1, self.offload_inputs if full else False)

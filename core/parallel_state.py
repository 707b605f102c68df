"""Rank layout and process groups, built once and passed explicitly (no module globals).

Layout order ``tp-cp-ep-dp-pp``, leftmost varying fastest (as Megatron): expert parallelism is
carved out of data parallelism, ``dp = ep * expert_dp``, so with ``world = tp*cp*dp*pp``::

    rank = tp_r + tp * (cp_r + cp * (ep_r + ep * (edp_r + edp * pp_r)))

Groups: ``pp`` (a pipeline), ``dp`` (dense-gradient replicas, EP ranks included), ``ep``
(ranks that split the experts), ``expert_dp`` (replicas of one expert shard), and ``embedding``
(first and last pipeline stage, which both hold the embedding when the last stage runs MTP).
tp and cp must be 1 for now; their sizes are accepted so the layout does not change later.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def local_device() -> torch.device:
    """This process's compute device: its GPU (set from LOCAL_RANK at start-up) or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


@dataclass(frozen=True)
class ParallelSizes:
    world: int
    pp: int = 1
    ep: int = 1
    vpp: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.dp // self.ep

    def validate(self, num_layers: int | None = None, num_experts: int | None = None) -> None:
        """Raise ``ValueError`` naming the flag, before any process group exists."""
        for name, v in (("world size", self.world), ("--pipeline-model-parallel-size", self.pp),
                        ("--expert-model-parallel-size", self.ep),
                        ("--virtual-pipeline-model-parallel-size", self.vpp)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.tp != 1 or self.cp != 1:
            raise ValueError("tensor and context parallelism are not implemented yet: "
                             "--tensor-model-parallel-size and --context-parallel-size must be 1")
        if self.world % (self.tp * self.cp * self.pp):
            raise ValueError(f"world size {self.world} is not divisible by tp*cp*pp = "
                             f"{self.tp * self.cp * self.pp} (--pipeline-model-parallel-size {self.pp})")
        if self.dp % self.ep:
            raise ValueError(f"--expert-model-parallel-size {self.ep} must divide the data-parallel "
                             f"size {self.dp} (world {self.world} / pp {self.pp}): EP is carved out of DP")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("--virtual-pipeline-model-parallel-size > 1 needs "
                             "--pipeline-model-parallel-size > 1")
        if num_layers is not None and num_layers < self.pp * self.vpp:
            raise ValueError(f"{num_layers} layers cannot fill pp {self.pp} x virtual stages "
                             f"{self.vpp} = {self.pp * self.vpp} stages")
        if num_experts == 0 and self.ep > 1:
            raise ValueError(f"--expert-model-parallel-size {self.ep}: the model has no experts (a dense "
                             "model); use 1")
        if num_experts is not None and num_experts % self.ep:
            raise ValueError(f"{num_experts} experts do not split over "
                             f"--expert-model-parallel-size {self.ep}")

    def coords(self, rank: int) -> dict:
        tp_r = rank % self.tp
        rest = rank // self.tp
        cp_r = rest % self.cp
        rest //= self.cp
        dp_r = rest % self.dp
        pp_r = rest // self.dp
        return {"tp": tp_r, "cp": cp_r, "dp": dp_r, "ep": dp_r % self.ep,
                "expert_dp": dp_r // self.ep, "pp": pp_r}

    def rank_of(self, tp=0, cp=0, dp=0, pp=0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def group_ranks(self) -> dict[str, list[list[int]]]:
        """Every group of every kind, as lists of global ranks (same order on every rank)."""
        out: dict[str, list[list[int]]] = {"pp": [], "dp": [], "ep": [], "expert_dp": [], "embedding": []}
        for tp in range(self.tp):
            for cp in range(self.cp):
                for pp in range(self.pp):
                    out["dp"].append([self.rank_of(tp, cp, d, pp) for d in range(self.dp)])
                    for edp in range(self.expert_dp):
                        out["ep"].append([self.rank_of(tp, cp, edp * self.ep + e, pp) for e in range(self.ep)])
                    for e in range(self.ep):
                        out["expert_dp"].append([self.rank_of(tp, cp, edp * self.ep + e, pp)
                                                 for edp in range(self.expert_dp)])
                for d in range(self.dp):
                    ranks = [self.rank_of(tp, cp, d, p) for p in range(self.pp)]
                    out["pp"].append(ranks)
                    out["embedding"].append(sorted({ranks[0], ranks[-1]}))
        return out


@dataclass
class ParallelState:
    """Sizes, this rank's coordinates, and its groups (``None`` where the group is just itself)."""

    sizes: ParallelSizes
    rank: int
    groups: dict = field(default_factory=dict)

    @classmethod
    def single(cls) -> "ParallelState":
        return cls(ParallelSizes(world=1), 0, {})

    @classmethod
    def build(cls, sizes: ParallelSizes, num_layers: int | None = None,
              num_experts: int | None = None, timeout=None) -> "ParallelState":
        """Validate, then create every group (collective: all ranks must call it). ``timeout``
        (a ``timedelta``, ``--distributed-timeout-minutes``): how long a collective of these
        groups waits for a rank; ``new_group`` would otherwise take torch's default (30 min for
        gloo), not the world group's."""
        sizes.validate(num_layers, num_experts)
        if dist.get_world_size() != sizes.world:
            raise ValueError(f"the job has {dist.get_world_size()} processes but the layout needs {sizes.world}")
        rank = dist.get_rank()
        mine = {}
        for kind, lists in sizes.group_ranks().items():
            for ranks in lists:
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    mine[kind] = (group, ranks)
        if sizes.world > 1:
            # a one-rank group per rank (created by all ranks, in order) for one-rank FSDP meshes:
            # experts that no other rank replicates (offload), mixed precision without sharding
            for r in range(sizes.world):
                group = dist.new_group([r], timeout=timeout)
                if r == rank:
                    mine["self"] = (group, [r])
        return cls(sizes, rank, mine)

    def _coord(self, kind: str) -> int:
        return self.sizes.coords(self.rank)[kind]

    def group(self, kind: str):
        return self.groups.get(kind, (None, [self.rank]))[0]

    def ranks(self, kind: str) -> list[int]:
        return self.groups.get(kind, (None, [self.rank]))[1]

    @property
    def pp_rank(self) -> int:
        return self._coord("pp")

    @property
    def dp_rank(self) -> int:
        return self._coord("dp")

    @property
    def ep_rank(self) -> int:
        return self._coord("ep")

    @property
    def expert_dp_rank(self) -> int:
        return self._coord("expert_dp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.sizes.pp - 1

    def pp_peer(self, offset: int) -> int:
        """Global rank of the pipeline stage ``offset`` away (wrapping, for virtual stages)."""
        return self.ranks("pp")[(self.pp_rank + offset) % self.sizes.pp]

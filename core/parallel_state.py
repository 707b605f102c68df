"""Rank layout and process groups, built once and passed explicitly (no module globals).

Layout order ``tp-cp-ep-dp-pp``, leftmost varying fastest (as Megatron), ``world =
tp*cp*dp*pp``::

    rank = tp_r + tp * (cp_r + cp * (dp_r + dp * pp_r))

Expert parallelism is carved out of data x context parallelism (as Megatron): within one
(tp, pp) slice the ``dp * cp`` ranks, numbered ``j = cp_r + cp * dp_r``, split as
``ep_r = j % ep``, ``expert_dp_r = j // ep``, so ``dp * cp = ep * expert_dp``. At cp 1 that is
the old ``dp = ep * expert_dp``; at CP8 x EP8 on 8 ranks (dp 1) the EP group is the CP group.
Each CP rank holds a different part of every pack, so an expert shard sees its EP group's tokens
whichever CP rank they come from, and its gradient sums over the ``expert_dp`` ranks, which span
CP ranks too.

Groups: ``pp`` (a pipeline), ``dp`` (data-parallel ranks: different packs), ``cp`` (ranks that
split one pack), ``dp_cp`` (dense-gradient replicas: dp x cp, EP ranks included; the ``dp``
group itself at cp 1), ``ep`` (ranks that split the experts), ``expert_dp`` (replicas of one
expert shard), and ``embedding`` (first and last pipeline stage, which both hold the embedding
when the last stage runs MTP). tp must be 1 for now; its size is accepted so the layout does
not change later.
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
        return self.dp * self.cp // self.ep

    def validate(self, num_layers: int | None = None, num_experts: int | None = None) -> None:
        """Raise ``ValueError`` naming the flag, before any process group exists."""
        for name, v in (("world size", self.world), ("--pipeline-model-parallel-size", self.pp),
                        ("--expert-model-parallel-size", self.ep),
                        ("--virtual-pipeline-model-parallel-size", self.vpp),
                        ("--context-parallel-size", self.cp)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.tp != 1:
            raise ValueError("tensor parallelism is not implemented yet: "
                             "--tensor-model-parallel-size must be 1")
        if self.world % (self.tp * self.cp * self.pp):
            raise ValueError(f"world size {self.world} is not divisible by tp*cp*pp = "
                             f"{self.tp * self.cp * self.pp} (--pipeline-model-parallel-size {self.pp}, "
                             f"--context-parallel-size {self.cp})")
        if (self.dp * self.cp) % self.ep:
            where = "data-parallel" if self.cp == 1 else "data-parallel x context-parallel"
            raise ValueError(f"--expert-model-parallel-size {self.ep} must divide the {where} "
                             f"size {self.dp * self.cp} (world {self.world} / pp {self.pp}): EP is "
                             f"carved out of {'DP' if self.cp == 1 else 'DP x CP'}")
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
        j = cp_r + self.cp * dp_r  # place among the dp x cp ranks of this (tp, pp): EP is carved from them
        return {"tp": tp_r, "cp": cp_r, "dp": dp_r, "ep": j % self.ep,
                "expert_dp": j // self.ep, "pp": pp_r}

    def rank_of(self, tp=0, cp=0, dp=0, pp=0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def _rank_of_j(self, tp: int, j: int, pp: int) -> int:
        """Global rank of the ``j``-th of the dp x cp ranks of slice (tp, pp)."""
        return self.rank_of(tp, j % self.cp, j // self.cp, pp)

    def group_ranks(self) -> dict[str, list[list[int]]]:
        """Every group of every kind, as lists of global ranks (same order on every rank). The
        ``cp`` and ``dp_cp`` kinds exist only at cp > 1 (``dp_cp`` is the ``dp`` group at cp 1)."""
        out: dict[str, list[list[int]]] = {"pp": [], "dp": [], "ep": [], "expert_dp": [], "embedding": []}
        if self.cp > 1:
            out.update(cp=[], dp_cp=[])
        for tp in range(self.tp):
            for pp in range(self.pp):
                for cp in range(self.cp):
                    out["dp"].append([self.rank_of(tp, cp, d, pp) for d in range(self.dp)])
                if self.cp > 1:
                    for d in range(self.dp):
                        out["cp"].append([self.rank_of(tp, c, d, pp) for c in range(self.cp)])
                    out["dp_cp"].append([self._rank_of_j(tp, j, pp) for j in range(self.dp * self.cp)])
                for edp in range(self.expert_dp):
                    out["ep"].append([self._rank_of_j(tp, edp * self.ep + e, pp) for e in range(self.ep)])
                for e in range(self.ep):
                    out["expert_dp"].append([self._rank_of_j(tp, edp * self.ep + e, pp)
                                             for edp in range(self.expert_dp)])
            for cp in range(self.cp):
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
    meshes: dict = field(default_factory=dict, repr=False, compare=False)  # (kind, device type) -> DeviceMesh

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

    def _kind(self, kind: str) -> str:
        return "dp" if kind == "dp_cp" and self.sizes.cp == 1 else kind

    def group(self, kind: str):
        return self.groups.get(self._kind(kind), (None, [self.rank]))[0]

    def mesh(self, kind: str, device_type: str):
        """A device mesh over this rank's ``kind`` group (``"self"``: a one-rank mesh), built once
        and kept: FSDP wrapping takes it, and the memory trace builds it before its fake tensors
        exist (a mesh built from fake tensors cannot read its ranks)."""
        from torch.distributed.device_mesh import DeviceMesh

        key = (self._kind(kind), device_type)
        if key not in self.meshes:
            one = kind == "self" and self.sizes.world == 1
            self.meshes[key] = DeviceMesh.from_group(dist.group.WORLD if one else self.group(kind), device_type)
        return self.meshes[key]

    def ranks(self, kind: str) -> list[int]:
        return self.groups.get(self._kind(kind), (None, [self.rank]))[1]

    @property
    def pp_rank(self) -> int:
        return self._coord("pp")

    @property
    def dp_rank(self) -> int:
        return self._coord("dp")

    @property
    def cp_rank(self) -> int:
        return self._coord("cp")

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

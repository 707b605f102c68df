"""Newton-Schulz split over the ranks that shard the matrices, instead of repeated on each.

Under FSDP each rank holds a block of rows of every dense matrix (dim-0 shards, ``torch.chunk``
sizes). Orthogonalising needs the whole matrix; gathering it on every rank would make every rank
run Newton-Schulz on every matrix, the same work D times. Here a batch of matrices sharded on one
mesh is dealt out to owners (greedy by Newton-Schulz FLOPs, the same on every rank): one
all-to-all takes each rank's rows of a matrix to its owner, the owner orthogonalises it whole, a
second all-to-all brings every rank its rows of the update. Each rank runs about 1/D of the
Newton-Schulz FLOPs, receives about 1/D of what an all-gather would bring it, and gets the bits
the replicated computation gives (the owner computes on the same whole matrix; the rows travel
already cast to Newton-Schulz's dtype, its first operation). Batches are cut where their FLOPs
reach D times their largest matrix's (``batches``), which deals them out evenly and bounds the
buffers a batch holds.

Expert stacks ``[E, out, in]`` sharded on dim 0 hold whole experts on each rank: they are
orthogonalised where they are, with no communication at all (``local_experts``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def row_counts(rows: int, world: int) -> list[int]:
    """Rows of each rank's dim-0 shard (``torch.chunk``: equal blocks, the last ones short or empty)."""
    block = -(-rows // world)
    return [max(0, min(block, rows - r * block)) for r in range(world)]


def ns_flops(shape, steps: int = 1) -> float:
    """Newton-Schulz FLOPs of one matrix (or stack) per ``steps`` iterations: ``4 m^2 n + 2 m^3``
    per matrix for m <= n."""
    m, n = sorted(shape[-2:])
    batch = 1
    for d in shape[:-2]:
        batch *= d
    return batch * steps * (4.0 * m * m * n + 2.0 * m ** 3)


def owners(shapes: list, world: int) -> list[int]:
    """The rank that orthogonalises each matrix: largest first, each to the least loaded rank
    (ties: the lower rank), so every rank computes the same assignment."""
    load = [0.0] * world
    out = [0] * len(shapes)
    for j in sorted(range(len(shapes)), key=lambda j: (-ns_flops(shapes[j]), j)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[j] = r
        load[r] += ns_flops(shapes[j])
    return out


def closes_batch(shapes: list, world: int) -> bool:
    """Whether matrices of these shapes make a batch: their Newton-Schulz FLOPs reach ``world``
    times the largest's, so owners can be dealt about as much work each as the largest matrix."""
    flops = [ns_flops(s) for s in shapes]
    return bool(flops) and sum(flops) >= world * max(flops)


def batches(shapes: list, world: int) -> list[list[int]]:
    """Indices of ``shapes`` in consecutive batches, each closed as soon as it ``closes_batch``
    (the last one may be short)."""
    out, held, total, largest = [], [], 0.0, 0.0
    for j, s in enumerate(shapes):  # closes_batch over ``held``, its sum and max kept as it grows
        f = ns_flops(s)
        held.append(j)
        total, largest = total + f, max(largest, f)
        if total >= world * largest:
            out.append(held)
            held, total, largest = [], 0.0, 0.0
    return out + ([held] if held else [])


def splittable(p) -> bool:
    """A 2-D matrix sharded by rows over more than one rank of a 1-D mesh."""
    return (isinstance(p, DTensor) and p.dim() == 2 and p.device_mesh.ndim == 1
            and p.device_mesh.size() > 1 and tuple(p.placements) == (Shard(0),))


def local_experts(p) -> bool:
    """An expert stack whose dim-0 shard holds whole matrices (orthogonalised in place)."""
    return isinstance(p, DTensor) and p.dim() == 3 and all(
        isinstance(x, Shard) and x.dim == 0 for x in p.placements)


def split_orthogonalise(grads: list, orthogonalise, dtype: torch.dtype) -> list[torch.Tensor]:
    """``orthogonalise`` of each whole matrix of ``grads`` (fp32 DTensors on one 1-D mesh, rows
    sharded, local parts on the compute device), this rank's rows of each result. ``dtype``: the
    one ``orthogonalise`` computes in and returns (it must start by casting its input to it): the
    rows travel in it both ways."""
    mesh = grads[0].device_mesh
    world, me, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    shapes = [tuple(g.shape) for g in grads]
    rows = [row_counts(s[0], world) for s in shapes]
    cols = [s[1] for s in shapes]
    own = owners(shapes, world)
    mine = [j for j in range(len(grads)) if own[j] == me]
    device = grads[0].to_local().device

    # 1. every rank's rows of a matrix to its owner
    # Newton-Schulz starts by casting to its dtype: cast the rows before they travel (same bits)
    by_dest = [[g.to_local().reshape(-1).to(dtype) for j, g in enumerate(grads) if own[j] == r]
               for r in range(world)]
    send = torch.cat([x for part in by_dest for x in part])
    in_splits = [sum(x.numel() for x in part) for part in by_dest]
    del by_dest
    out_splits = [sum(rows[j][s] * cols[j] for j in mine) for s in range(world)]
    recv = send.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)

    # 2. the owner orthogonalises each of its matrices whole
    blocks = [[] for _ in mine]
    for s, piece in enumerate(recv.split(out_splits)):
        sizes = [rows[j][s] * cols[j] for j in mine]
        for i, (j, flat) in enumerate(zip(mine, piece.split(sizes))):
            blocks[i].append(flat.view(rows[j][s], cols[j]))
    updates = [orthogonalise(torch.cat(b)) for b in blocks]

    # 3. every rank its rows of each update
    back = [[u[sum(rows[j][:s]):sum(rows[j][:s + 1])].reshape(-1) for j, u in zip(mine, updates)]
            for s in range(world)]
    send2 = torch.cat([x for part in back for x in part]) if mine else torch.empty(0, dtype=dtype, device=device)
    in2 = [sum(x.numel() for x in part) for part in back]
    from_owner = [[j for j in range(len(grads)) if own[j] == s] for s in range(world)]
    out2 = [sum(rows[j][me] * cols[j] for j in js) for js in from_owner]
    recv2 = torch.empty(sum(out2), dtype=dtype, device=device)
    dist.all_to_all_single(recv2, send2.to(dtype), out2, in2, group=group)
    result: list = [None] * len(grads)
    for s, piece in enumerate(recv2.split(out2)):
        js = from_owner[s]
        for j, flat in zip(js, piece.split([rows[j][me] * cols[j] for j in js])):
            result[j] = flat.view(rows[j][me], cols[j])
    return result


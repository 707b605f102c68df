"""Host allocations made while code runs, from torch's profiler (``profile_memory``): each op's
own allocations, temporaries freed inside it included. A GPU's memory follows the same ops, so
bytes allocated on the CPU here are the bytes a CUDA step would allocate on the device."""
from __future__ import annotations

from torch.profiler import ProfilerActivity, profile


def allocations(fn) -> list[tuple[str, int]]:
    """``(op, bytes)`` of every op that allocated host memory for itself while ``fn()`` ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [(e.name, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage > 0]


def largest_allocation(fn) -> int:
    """The largest single allocation ``fn()`` made (bytes; 0 if none)."""
    return max((b for _, b in allocations(fn)), default=0)

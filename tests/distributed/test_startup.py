"""Start-up (issue 14): chunks built on meta, sharded, then only this rank's shards allocated and
written once, seeded or streamed from a Hugging Face checkpoint.

- Every layout (PP, EP, DP, FSDP with and without CPU offload, bf16 one-rank meshes, uneven and
  empty dim-0 shards) holds exactly the rows of one process's tensors: seeded (seed 0) and loaded
  (the checkpoint's source model), buffers in fp32; exact, since nothing is summed.
- A load asks the checkpoint for exactly as many elements as the rank holds.
- Peak host memory while a ~1B-parameter model starts at PP2 x EP2 with FSDP stays within
  1.3 x the rank's shard bytes plus ``ALLOWANCE`` over the RSS measured before the build."""
from __future__ import annotations

import json

import pytest

from tests.distributed.harness import Prepared, run_ranks
from tests.distributed.startup_cases import (ALLOWANCE, PEAK_FACTOR, check_hf_streaming,
                                             check_startup_memory, source_model)
from tests.distributed.parallel_cases import tiny_config

FSDP = ("--data-parallel-sharding", "fsdp")
LAYOUTS = {  # name: (world, pp, ep, flags)
    "dp2_fsdp_offload_all": (2, 1, 1, (*FSDP, "--cpu-offload", "all")),
    "pp2_ep2_fsdp_offload_experts": (4, 2, 2, (*FSDP, "--cpu-offload", "experts")),
    "ep2_expert_dp2_fsdp": (4, 1, 2, FSDP),  # experts sharded too; g_proj's 6 rows: 2, 2, 2, 0
    "pp2_bf16": (2, 2, 1, ("--bf16",)),      # one-rank meshes
}


def _hf_dir(path: str) -> str:
    source_model(tiny_config()).save_hf(path)  # transformers' layout: fused gate_up halves
    return path


HF_DIR = Prepared(_hf_dir)
# name -> (world, fn, args): the cases of one world size share one spawn (tests/distributed/conftest.py)
CASES = {name: (world, check_hf_streaming, (pp, ep, flags, HF_DIR)) for name, (world, pp, ep, flags) in LAYOUTS.items()}


@pytest.mark.parametrize("case", LAYOUTS)
def test_every_layout_holds_the_rows_of_one_process(shared_ranks, case):
    shared_ranks.check((__name__, case))


def test_peak_host_memory_of_a_1b_model_at_pp2_ep2(tmp_path):
    # ranks of its own, not shared: a peak of host memory is measured (see startup_cases)
    run_ranks(4, check_startup_memory, 2, 2, FSDP, str(tmp_path), tmpdir=str(tmp_path), timeout=240)
    rows = [json.load(open(tmp_path / f"memory{r}.json")) for r in range(4)]
    total = sum(r["parameters"] for r in rows)  # FSDP: no replicas (plus the MTP embedding copy)
    assert 0.9e9 < total < 1.1e9, total
    for r in rows:
        print(f"baseline {r['baseline'] / 2**20:.0f} MiB, shards {r['held'] / 2**20:.0f} MiB, peak "
              f"{r['peak'] / 2**20:.0f} MiB = baseline + {(r['peak'] - r['baseline']) / r['held']:.3f} x "
              f"shards (bound {PEAK_FACTOR} x + {ALLOWANCE / 2**20:.0f} MiB)")

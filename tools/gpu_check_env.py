#!/usr/bin/env python3
"""The first part of the GPU check: what this machine runs (Python, torch and its CUDA, cuDNN and
NCCL, transformers or its absence, the GPU, its memory and driver) and which of torch's features
that differ across releases this torch has (``varlen_attn``'s keywords, ``grouped_mm``, fp32-output
GEMMs), so every number after it can be read against its software."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def facts() -> dict:
    import torch
    import torch.nn.functional as F

    from core.loss import _out_dtype_gemm
    from core.transformer.attention_backends import VARLEN

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version(), "grouped_mm": hasattr(F, "grouped_mm"),
           "varlen_keywords": sorted(VARLEN.keywords) if VARLEN else None}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                   gpus=torch.cuda.device_count(), nccl=".".join(map(str, torch.cuda.nccl.version())),
                   fp32_out_gemm=_out_dtype_gemm(torch.device("cuda"), torch.bfloat16))
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            out["driver"] = None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    f = facts()
    for k, v in f.items():
        print(f"{k}: {v}")
    gpu = f"{f['gpu']} ({f['gpu_gib']} GiB, sm {f['capability']}, driver {f.get('driver')})" if "gpu" in f else "no GPU"
    headline = (f"{gpu}; Python {f['python']}, torch {f['torch']} (CUDA {f['cuda']}), transformers "
                f"{f['transformers'] or 'absent'}; varlen enable_gqa: "
                f"{'yes' if f['varlen_keywords'] and 'enable_gqa' in f['varlen_keywords'] else 'no'}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**f, "passed": True, "headline": headline}, fh, indent=2)
    print(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())

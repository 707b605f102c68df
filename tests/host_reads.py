"""Count reads of tensor values by the host (each a device sync on a GPU) while code runs:
``item``/``int``/``float``/``bool`` (aten ``_local_scalar_dense``), ``tolist``, ``nonzero``,
boolean-mask indexing, ``masked_select``, ``bincount`` and ``repeat_interleave`` without
``output_size`` (whose output size depends on the values). Forward and backward both: the
dispatch mode sees the ops the autograd engine runs."""
from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_DISPATCH = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
             "aten.bincount.default"}


class HostReads:
    def __init__(self):
        self.reads: list[tuple[str, str]] = []  # (what, where)
        outer = self

        class _Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") == "tolist":
                    outer._note("tolist")
                return func(*args, **(kwargs or {}))

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                kwargs = kwargs or {}
                if name in _DISPATCH:
                    outer._note(name)
                elif name == "aten.index.Tensor" and any(
                        i is not None and i.dtype == torch.bool for i in args[1]):
                    outer._note("boolean mask indexing")
                elif name.startswith("aten.repeat_interleave") and kwargs.get("output_size") is None \
                        and (len(args) < 4 or args[3] is None):
                    outer._note("repeat_interleave without output_size")
                return func(*args, **kwargs)

        self._modes = (_Functions(), _Dispatch())

    def _note(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()
                  if "/torch/" not in f.filename and not f.filename.endswith("host_reads.py")]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        self.reads.append((what, where))

    def __enter__(self):
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)


class HostToDevice(TorchDispatchMode):
    """Count ops that take a host tensor (not a 0-d scalar) and produce a tensor elsewhere: the
    blocking host-to-device copies of a step. On a CPU-only machine the ``meta`` device stands
    in for the GPU (a model and batch on ``meta`` run every op with shapes only)."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple[str, str]] = []  # (op, where)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = torch.utils._pytree.tree_leaves
        ins = [t for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in leaves(out) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" and t.dim() > 0 for t in ins) and any(t.device.type != "cpu" for t in outs):
            frames = [f for f in traceback.extract_stack()
                      if "/torch/" not in f.filename and not f.filename.endswith("host_reads.py")]
            self.copies.append((str(func), f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"))
        return out

"""Measuring what autograd keeps for backward (the activation memory of a forward pass)."""
from __future__ import annotations

import torch


class SavedTensorBytes:
    """Context manager: bytes of the distinct storages autograd saves for backward inside it.

    Parameters (and views of them, e.g. a transposed weight) are not activations: pass the
    module(s) whose parameter storages to leave out."""

    def __init__(self, *modules):
        self.exclude = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self.storages: dict = {}

    def _pack(self, t: torch.Tensor):
        if not (t.is_leaf and t.requires_grad):
            s = t.untyped_storage()
            if s.data_ptr() not in self.exclude:
                self.storages[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

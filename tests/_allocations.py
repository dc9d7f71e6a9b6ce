"""Counting the memory an operation allocates: the bytes of every storage created while a
:class:`NewStorageBytes` mode is on (the Falcon tests' bound on what a measurement or an exchange allocates)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class NewStorageBytes(TorchDispatchMode):
    """Bytes of every storage an op creates while the mode is on (kept alive, so an address freed
    and reused is still counted: the sum bounds the peak)."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.seen = {t.untyped_storage().data_ptr() for t in existing}
        self.kept: list = []
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.seen:
                    self.seen.add(storage.data_ptr())
                    self.kept.append(storage)
                    self.bytes += storage.nbytes()
        return out

"""Count the host reads (device syncs) a piece of code makes: each stalls a GPU's queue.

    with capskip_fx.debug.count_host_reads() as reads:
        loss.backward()
    print(len(reads), reads)

Counted: ``item()/int()/float()/bool()`` of a tensor (``aten._local_scalar_dense``), nonzero-like ops
(``nonzero``, ``masked_select``, ``repeat_interleave`` with a tensor, boolean-mask indexing) and
``Tensor.tolist`` (which does not dispatch: it is patched for the duration of the block, process-wide).
Reads inside capskip's custom ops (the selection, VCAS's sampled weight gradient) are counted too.
Device-agnostic: a CPU run counts the reads a CUDA run would sync on.  On CUDA,
``torch.cuda.set_sync_debug_mode("warn")`` reports the syncs themselves.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
             aten.repeat_interleave.Tensor}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class _Reads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "capskip":  # run our custom ops' Python bodies under the mode: their reads count
            with self:
                return OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        if func in _SYNC_OPS:
            self.ops.append(str(func))
        elif func in _INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                        for i in args[1] if i is not None):
            self.ops.append(f"{func} (mask index)")  # a boolean index is a nonzero
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_reads() -> Iterator[list[str]]:
    """Yields a list that gets one entry (the op's name) per host read made inside the block."""
    mode = _Reads()
    orig = torch.Tensor.tolist

    def tolist(t):
        mode.ops.append("tolist")
        return orig(t)

    torch.Tensor.tolist = tolist
    try:
        with mode:
            yield mode.ops
    finally:
        torch.Tensor.tolist = orig

"""Count the host reads (device syncs) a piece of code makes: each stalls a GPU's queue; and the aten ops
it runs eagerly, outside compiled graphs (:func:`count_eager_ops`).

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

import collections
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


_GRAPH_MARK = "## Call CompiledFxGraph"  # Inductor's profiler range around each compiled graph's run


class EagerOps:
    """What :func:`count_eager_ops` counted: ``eager`` (aten op name -> calls made outside compiled graphs)
    and ``in_graphs`` (the aten ops compiled graphs dispatch themselves: extern kernels such as mm, and what
    Inductor could not fuse, such as a Python custom op's body)."""

    def __init__(self) -> None:
        self.eager: collections.Counter = collections.Counter()
        self.in_graphs: collections.Counter = collections.Counter()

    def __len__(self) -> int:
        return sum(self.eager.values())

    def __repr__(self) -> str:
        return f"EagerOps(eager={len(self)}, in_graphs={sum(self.in_graphs.values())})"


@contextlib.contextmanager
def count_eager_ops() -> Iterator[EagerOps]:
    """Counts the aten ops the block dispatches outside Inductor's compiled graphs (filled when the block
    ends).  An op counts once, where it is called: the aten ops it calls itself are not counted again.  Read
    with torch.profiler (every thread, the autograd engine's included); Inductor marks each compiled graph's
    run while profiling.  Graphs of other backends (aot_eager interprets its graphs op by op) are not
    marked: their ops count as eager."""
    from torch.profiler import ProfilerActivity, profile

    out = EagerOps()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield out
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        p = e.cpu_parent
        while p is not None and not (p.name.startswith("aten::") or p.name.startswith(_GRAPH_MARK)):
            p = p.cpu_parent
        if p is None:
            out.eager[e.name] += 1
        elif p.name.startswith(_GRAPH_MARK):
            out.in_graphs[e.name] += 1


def eager_ops_per_step(cm, model: torch.nn.Module, batches, warmup: int, stats=None) -> list:
    """One cross-entropy training step of ``cm`` per ``(x, y)`` in ``batches``, each counted by
    :func:`count_eager_ops`; for every step after the first ``warmup``: ``(its EagerOps, stats(cm))``, the
    stats from ``stats`` (e.g. ``capskip_fx.stats``; None for a model capskip did not compile).  The eager-op
    benchmark (benchmarks/eager_ops.py) and its test share it."""
    out = []
    for step, (x, y) in enumerate(batches):
        model.zero_grad(set_to_none=True)
        with count_eager_ops() as ops:
            torch.nn.functional.cross_entropy(cm(x), y).backward()
        if step >= warmup:
            out.append((ops, stats(cm) if stats is not None else None))
    return out

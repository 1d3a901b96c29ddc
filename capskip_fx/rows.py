"""How a backward input carries the batch (Spec), and the row gather / scatter that follow it.

Specs are read from the *example inputs* of the compiled backward (real strides from the compiled
forward, not node meta).  A batch-shaped input has one dim of size ``factor * s``, batch-major
(index ``b * factor + r``); whether it really is batch-major is proven by the layout analysis of
the forward (layout.py), not by this size match.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import sympy
import torch

from .passes.batch import Refused, batch_dim, expr_of


@dataclass
class Spec:
    kind: str  # "static" | "symint" | "batch"
    expr: Optional[sympy.Expr] = None
    dim: int = 0
    factor: int = 1
    sizes: tuple = ()
    strides: tuple = ()


def spec_of(v: Any, sym: sympy.Symbol) -> Spec:
    if isinstance(v, torch.SymInt):
        e = v.node.expr
        if sym not in e.free_symbols:  # e.g. a dynamic storage offset: its value passes through
            return Spec("static")
        if e.free_symbols != {sym}:
            raise Refused(f"backward input size {e} depends on symbols other than the batch {sym}")
        return Spec("symint", expr=e)
    if isinstance(v, torch.Tensor):
        free = set().union(*(expr_of(s).free_symbols for s in (*v.shape, *v.stride())))
        if not free:
            return Spec("static")
        if free != {sym}:
            raise Refused(f"backward input of shape {tuple(v.shape)} has dynamic dims other than the batch")
        bd = batch_dim(v.shape, sym)
        if bd is None:
            raise Refused(f"backward input of shape {tuple(v.shape)} has the batch only in its strides")
        return Spec("batch", dim=bd[0], factor=bd[1], sizes=tuple(expr_of(s) for s in v.shape),
                    strides=tuple(expr_of(s) for s in v.stride()))
    return Spec("static")


def conform(x: torch.Tensor, sizes, strides) -> torch.Tensor:
    """``x`` with the exact sizes/strides a compiled graph asserts for this input (a copy if needed)."""
    if tuple(x.shape) == tuple(sizes) and x.stride() == tuple(strides):
        return x
    out = torch.empty_strided(sizes, strides, dtype=x.dtype, device=x.device)
    out.copy_(x)
    return out


def gather_rows(x: torch.Tensor, spec: Spec, idx: torch.Tensor, n: int, sizes, strides) -> torch.Tensor:
    if spec.factor == 1:
        y = x.index_select(spec.dim, idx)
    else:
        y = x.unflatten(spec.dim, (n, spec.factor)).index_select(spec.dim, idx).flatten(spec.dim, spec.dim + 1)
    return conform(y, sizes, strides)  # Inductor asserts input strides


def _row_block(x: torch.Tensor, spec: Spec, n: int) -> Optional[tuple]:
    """((storage, dtype), start, R, elements per row) when row ``b`` of ``x`` lies in its storage's elements
    ``[start + b*R, start + (b+1)*R)`` (batch in dim 0, non-negative strides): then gathering those
    blocks and viewing them with ``x``'s own strides is the row gather.  None otherwise."""
    if spec.dim != 0 or x.numel() == 0 or x.shape[0] != n * spec.factor or any(st < 0 for st in x.stride()):
        return None
    r = x.stride(0) * spec.factor
    if r <= 0:
        return None
    off = x.storage_offset()
    start = off - off % r
    extent = off % r + (spec.factor - 1) * x.stride(0) + sum((sz - 1) * st for sz, st in zip(x.shape[1:], x.stride()[1:]))
    if extent >= r or start + n * r > x.untyped_storage().nbytes() // x.element_size():
        return None
    per_row = spec.factor * math.prod(x.shape[1:])
    return (x.untyped_storage().data_ptr(), x.dtype), start, r, per_row


def gather_all(args: list, specs: list, idx: torch.Tensor, n: int, layouts: list) -> list:
    """The row gather of every batch-shaped argument (``layouts[i]``: its (sizes, strides) at ``len(idx)``
    rows).  Arguments that are views of one batch-major buffer (q, k and v of one qkv matmul) are
    gathered once, as whole row blocks of the buffer, and viewed with their own strides: no strided
    copy when those strides are the compiled graph's.  Others: ``gather_rows``."""
    kb = idx.numel()
    blocks: dict = {}
    plan = []
    for i, (a, s) in enumerate(zip(args, specs)):
        rb = _row_block(a, s, n) if s.kind == "batch" and tuple(layouts[i][1]) == a.stride() and \
            tuple(layouts[i][0]) == (kb * s.factor,) + tuple(a.shape[1:]) else None
        plan.append(rb)
        if rb is not None:
            key = rb[:3]
            blocks[key] = blocks.get(key, 0) + rb[3]
    # a block pays when its views cover at least half of it (else gather just the view)
    use = {k for k, covered in blocks.items() if 2 * covered >= k[2]}
    gathered: dict = {}
    out = []
    for a, s, lay, rb in zip(args, specs, layouts, plan):
        if rb is not None and rb[:3] in use:
            key = rb[:3]
            _, start, r = key
            if key not in gathered:
                gathered[key] = a.as_strided((n, r), (r, 1), start).index_select(0, idx)
            out.append(gathered[key].as_strided(tuple(lay[0]), a.stride(), a.storage_offset() % r))
        else:
            out.append(gather_rows(a, s, idx, n, *lay))
    return out


def scatter_rows(y: torch.Tensor, spec: Spec, idx: torch.Tensor, n: int) -> torch.Tensor:
    shape = list(y.shape)
    shape[spec.dim] = n * spec.factor
    full = y.new_zeros(shape)
    if spec.factor == 1:
        full.index_copy_(spec.dim, idx, y)
    else:
        full.unflatten(spec.dim, (n, spec.factor)).index_copy_(
            spec.dim, idx, y.unflatten(spec.dim, (y.shape[spec.dim] // spec.factor, spec.factor)))
    return full

"""How a backward input carries the batch (Spec), and the row gather / scatter that follow it.

Specs are read from the *example inputs* of the compiled backward (real strides from the compiled
forward, not node meta).  A batch-shaped input has one dim of size ``factor * s``, batch-major
(index ``b * factor + r``); whether it really is batch-major is proven by the layout analysis of
the forward (layout.py), not by this size match.
"""
from __future__ import annotations

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

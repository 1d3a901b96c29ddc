"""The row gather / scatter of a backward input along its batch dim (a ``symbolic.Spec``).

Specs are read from the *example inputs* of the compiled backward (real strides from the compiled
forward, not node meta).  A batch-shaped input has one dim of size ``outer * s * factor``, index
``(o * s + b) * factor + r``: batch-major when ``outer == 1``, token-major otherwise (the layout proof of
the forward, placement/, says which; the sizes alone cannot: ``T*s == s*T``).  Row ``b`` is gathered as
the ``b``-th slice of that dim viewed ``(outer, s, factor)``.
"""
from __future__ import annotations

import collections
import math
from typing import Optional

import torch

from .symbolic import Spec


def conform(x: torch.Tensor, sizes, strides) -> torch.Tensor:
    """``x`` with the exact sizes/strides a compiled graph asserts for this input (a copy if needed)."""
    if tuple(x.shape) == tuple(sizes) and x.stride() == tuple(strides):
        return x
    out = torch.empty_strided(sizes, strides, dtype=x.dtype, device=x.device)
    out.copy_(x)
    return out


def gather_rows(x: torch.Tensor, spec: Spec, idx: torch.Tensor, n: int, sizes, strides) -> torch.Tensor:
    d = spec.dim
    if spec.factor == 1 and spec.outer == 1:
        y = x.index_select(d, idx)
    elif spec.outer == 1:
        y = x.unflatten(d, (n, spec.factor)).index_select(d, idx).flatten(d, d + 1)
    else:  # token-major: the batch is the middle of (outer, n, factor)
        y = x.unflatten(d, (spec.outer, n, spec.factor)).index_select(d + 1, idx).flatten(d, d + 2)
    return conform(y, sizes, strides)  # Inductor asserts input strides


def _row_block(x: torch.Tensor, spec: Spec, n: int) -> Optional[tuple]:
    """((storage, dtype), start, R, elements per row) when row ``b`` of ``x`` lies in its storage's elements
    ``[start + b*R, start + (b+1)*R)`` (batch in dim 0, non-negative strides): then gathering those
    blocks and viewing them with ``x``'s own strides is the row gather.  None otherwise."""
    if spec.dim != 0 or spec.outer != 1 or x.numel() == 0 or x.shape[0] != n * spec.factor or \
            any(st < 0 for st in x.stride()):
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


def gather_all(args: list, specs: list, idx: torch.Tensor, n: int, shapes: list) -> list:
    """The row gather of every batch-shaped argument (``shapes[i]``: its (sizes, strides) at ``len(idx)``
    rows).  Arguments that are views of one batch-major buffer (q, k and v of one qkv matmul) are
    gathered once, as whole row blocks of the buffer, and viewed with their own strides: no strided
    copy when those strides are the compiled graph's.  Others: ``gather_rows``."""
    kb = idx.numel()
    blocks: dict = {}
    row_blocks = []
    for i, (a, s) in enumerate(zip(args, specs)):
        rb = _row_block(a, s, n) if s.kind == "batch" and tuple(shapes[i][1]) == a.stride() and \
            tuple(shapes[i][0]) == (kb * s.factor,) + tuple(a.shape[1:]) else None
        row_blocks.append(rb)
        if rb is not None:
            key = rb[:3]
            blocks[key] = blocks.get(key, 0) + rb[3]
    # a block pays when its views cover at least half of it (else gather just the view); a block that is
    # one contiguous batch-major argument is that argument's own index_select (one op, no views around it)
    use = {k for k, covered in blocks.items() if 2 * covered >= k[2]}
    views = collections.Counter(rb[:3] for rb in row_blocks if rb is not None)
    gathered: dict = {}
    out = []
    for a, s, shape, rb in zip(args, specs, shapes, row_blocks):
        if rb is not None and views[rb[:3]] == 1 and s.factor == 1 and a.is_contiguous():
            out.append(conform(a.index_select(0, idx), *shape))
        elif rb is not None and rb[:3] in use:
            key = rb[:3]
            _, start, r = key
            if key not in gathered:
                gathered[key] = a.as_strided((n, r), (r, 1), start).index_select(0, idx)
            out.append(gathered[key].as_strided(tuple(shape[0]), a.stride(), a.storage_offset() % r))
        else:
            out.append(gather_rows(a, s, idx, n, *shape))
    return out


def scatter_rows(y: torch.Tensor, spec: Spec, idx: torch.Tensor, n: int) -> torch.Tensor:
    shape = list(y.shape)
    shape[spec.dim] = spec.outer * n * spec.factor
    full = y.new_zeros(shape)
    d = spec.dim
    if spec.factor == 1 and spec.outer == 1:
        full.index_copy_(spec.dim, idx, y)
    elif spec.outer != 1:
        full.unflatten(d, (spec.outer, n, spec.factor)).index_copy_(
            d + 1, idx, y.unflatten(d, (spec.outer, idx.numel(), spec.factor)))
    else:
        full.unflatten(spec.dim, (n, spec.factor)).index_copy_(
            spec.dim, idx, y.unflatten(spec.dim, (y.shape[spec.dim] // spec.factor, spec.factor)))
    return full

"""An in-graph cross-entropy's ``dL/dz``, derived from the forward's values for the rule to choose from.

passes/loss_grad.py recognised the loss at compile time and left a recipe (``CrossEntropyGrad``, read here by
its fields only: the runtime imports no pass) and the backward inputs it reads (the labels, the class weights,
the scalar divisors, the loss's and the logits' tangents).  :func:`derived_grad` computes, on every row, in the
selection dtype (float32, float64 for float64 logits),

    dL/dz = t_L * J^T (G - softmax(x) * sum_c G) + t_z,    G = sum_k c_k / prod(D_k) * dS_k/dlog p

with ``x`` the flat logits the loss reads (``J``: the path from ``z``: views, token slices, a scale), ``S_k``
the recipe's terms, ``t_L`` the loss output's tangent and ``t_z`` the logits output's: exactly what the loss's
own backward (the prefix) returns, up to rounding.  The rule then chooses, and the prefix runs on the kept rows
only (runtime/backward.py): the gradients still come from the prefix; the derived ``dL/dz`` only feeds the rule.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def _replay_labels(ops, y: Tensor) -> Tensor:
    for op in ops:
        if op[0] == "pad":
            y = F.pad(y, list(op[1]), value=op[2])
        elif op[0] == "slice":
            y = y.narrow(op[1], *_span(op[2], op[3], y.shape[op[1]]))
        elif op[0] == "flatten":
            y = y.reshape(-1)
    return y.reshape(-1)


def _span(start: int, end: Optional[int], size: int) -> tuple[int, int]:
    """(start, length) of ``[start:end]`` on a dim of ``size``, as Python slices clamp."""
    lo, hi, _ = slice(start, end).indices(size)
    return lo, max(0, hi - lo)


def derived_grad(recipe: Any, z: Tensor, inputs: list) -> tuple[Tensor, Tensor]:
    """``(dL/dz, targets)``: dL/dz shaped like ``z`` in the selection dtype, and the label of each row (token)
    of ``z`` the loss reads (-1 where it reads none: an ignored label, a position the shift drops)."""
    dt = torch.float64 if z.dtype == torch.float64 else torch.float32
    got = dict.fromkeys(recipe.inputs)
    divisors = {}
    for i, (role, t) in enumerate(zip(recipe.inputs, inputs)):
        if role == "divisor":
            divisors[i] = t
        else:
            got[role] = t
    with torch.no_grad():
        x = z.detach().to(dt)
        shapes, scale = [], 1.0
        for op in recipe.logits_ops:
            shapes.append((op, x.shape))
            if op[0] == "slice":
                x = x.narrow(op[1], *_span(op[2], op[3], x.shape[op[1]]))
            elif op[0] == "flatten":
                x = x.reshape(-1, x.shape[-1])
            elif op[0] == "scale":
                x = x * op[1]
                scale *= op[1]
        x = x.reshape(-1, x.shape[-1])
        y = _replay_labels(recipe.label_ops, got["labels"].to(z.device))
        valid = y != recipe.ignore_index
        yc = torch.where(valid, y, torch.zeros_like(y)).long()
        w = got.get("weight")
        w = w.to(device=z.device, dtype=dt) if w is not None else None
        vf = valid.to(dt)
        count = {"count": vf.sum(), "weights": (w[yc] * vf).sum() if w is not None else None}
        target_coef = x.new_zeros(x.shape[0])  # G's entry at the label, per token
        all_coef = None  # G's row shared by every class (label smoothing), per token and class
        for term in recipe.terms:
            den = x.new_ones(())
            for d in term.denominators:
                den = den * (count[d] if isinstance(d, str) else divisors[d].to(device=z.device, dtype=dt).reshape(()))
            a = vf * (term.coef / den)
            if term.kind == "target":
                target_coef = target_coef + (a * w[yc] if term.weighted else a)
            else:
                row = a[:, None] * (w[None, :] if term.weighted else x.new_ones(1, x.shape[-1]))
                all_coef = row if all_coef is None else all_coef + row
        p = torch.softmax(x, -1)
        g = all_coef if all_coef is not None else x.new_zeros(x.shape)
        g = g.scatter_add(1, yc[:, None], target_coef[:, None])
        dx = g - p * g.sum(-1, keepdim=True)
        # back through the logits' path: undo the flatten, put the slices back (zeros elsewhere), the scale
        tok = torch.where(valid, y, torch.full_like(y, -1))
        for op, shape in reversed(shapes):
            if op[0] == "flatten":
                dx, tok = dx.reshape(shape), tok.reshape(shape[:-1])
            elif op[0] == "slice":
                lo, length = _span(op[2], op[3], shape[op[1]])
                dx = _scatter_slice(dx, shape, op[1], lo, length, 0)
                tok = _scatter_slice(tok, shape[:-1], op[1], lo, length, -1)
        dx = dx.reshape(z.shape) * scale
        tok = tok.reshape(z.shape[:-1])
        t_loss = got["loss_tangent"]
        dz = dx * t_loss.to(device=z.device, dtype=dt).reshape(())
        t_z = got.get("logits_tangent")
        if t_z is not None:
            dz = dz + t_z.to(dt).reshape(z.shape)
    return dz, tok


def _scatter_slice(t: Tensor, shape, dim: int, lo: int, length: int, fill) -> Tensor:
    out = t.new_full(tuple(shape), fill)
    out.narrow(dim, lo, length).copy_(t)
    return out

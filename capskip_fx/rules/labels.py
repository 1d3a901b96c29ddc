"""Labels, correctness and per-example losses derived from what the head sees.

For the cross-entropy family the logits' incoming gradient is ``delta = s * (softmax(z) - t)``
with ``s > 0`` (1/N, loss scale, accumulation factor): the label is its most negative entry.
With label smoothing an over-confident row can have other negative entries too, so the
inferred label is only trusted when it is the row's argmin AND negative; pass explicit
targets (``capskip_targets=``) for other losses or soft targets.
A row whose delta is exactly zero contributes nothing to any gradient: it is "free".
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def infer_targets(delta: Tensor) -> Tensor:
    """(N,) int64 labels from dL/dz; -1 where no negative entry exists (label unknown)."""
    mn, arg = delta.min(dim=1)
    return torch.where(mn < 0, arg, torch.full_like(arg, -1))


def zero_rows(delta: Tensor) -> Tensor:
    return (delta == 0).all(dim=1)


def correct_mask(delta: Tensor, z: Tensor, targets: Optional[Tensor]) -> Tensor:
    """Rows the model classifies correctly, plus zero-gradient rows (free to skip)."""
    y = infer_targets(delta) if targets is None else targets.to(z.device).long()
    correct = (z.argmax(dim=1) == y) & (y >= 0)
    return correct | zero_rows(delta)


def per_example_ce(z: Tensor, targets: Tensor) -> Tensor:
    """Per-example cross-entropy in float32 (float64 for float64 logits); NaN where label unknown."""
    dt = torch.float64 if z.dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(z.to(dt), dim=1)
    y = targets.clamp_min(0)
    loss = lse - z.to(dt).gather(1, y[:, None]).squeeze(1)
    return torch.where(targets >= 0, loss, torch.full_like(loss, float("nan")))


#: softmax_residual above this: dL/dz is not from a loss of softmax(z); labels can't be inferred.
#: CE-family gradients sit at rounding level (< 1e-2 even with bf16 tangents), MSE near 0.8.
SOFTMAX_RESIDUAL_TOL = 0.1


def softmax_residual(delta: Tensor) -> Tensor:
    """0-dim (no sync): ``sum_i |sum_j delta_ij| / sum_i ||delta_i||``.

    A loss that sees z only through softmax(z) (cross-entropy with hard, smoothed or soft targets,
    class weights, focal) is invariant to ``z + c``, so every row of dL/dz sums to 0.  MSE on the
    logits is not: its rows sum to ~their norm.  Rows of zeros (ignore_index) count for nothing.
    """
    d = delta.double() if delta.dtype == torch.float64 else delta.float()
    den = torch.linalg.vector_norm(d, dim=1).sum()
    return d.sum(1).abs().sum() / den.clamp_min(torch.finfo(d.dtype).tiny)


def bad_targets(targets: Tensor, num_classes: int) -> Tensor:
    """0-dim bool (no sync): some explicit label is outside [-1, C) (-1 = unknown)."""
    return ((targets < -1) | (targets >= num_classes)).any()

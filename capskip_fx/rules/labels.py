"""Labels, correctness and per-example losses derived from what the head sees.

For the cross-entropy family the logits' incoming gradient is ``delta = s * (softmax(z) - t)``
with ``s > 0`` (1/N, loss scale, accumulation factor): the label is its most negative entry.
With label smoothing an over-confident row can have other negative entries too, so the
inferred label is only trusted when it is the row's argmin AND negative; pass explicit
targets (``capskip_targets=``) for other losses or soft targets.
A row whose delta is exactly zero contributes nothing to any gradient: it is "free".

Token-shaped heads (a causal LM, token classification): ``delta`` and ``z`` are (N, T, C), a row is a
sequence and the functions here work per token, then per sequence.  A token whose delta is exactly zero
(label -100 / ``ignore_index``, the position the shifted labels drop, padding) is ignored: it counts in no
sequence's loss.
"""
from __future__ import annotations

from typing import Optional

import math

import torch
from torch import Tensor


def infer_targets(delta: Tensor) -> Tensor:
    """(N,) int64 labels from dL/dz; -1 where no negative entry exists (label unknown);
    (N, T) per token for token-shaped ``delta`` (N, T, C)."""
    mn, arg = delta.min(dim=-1)
    return torch.where(mn < 0, arg, -1)


def zero_rows(delta: Tensor) -> Tensor:
    """(N,) rows (sequences, for token-shaped delta) whose gradient is exactly zero."""
    # any() of a float is "nonzero" (NaN counts): 2-3x faster than (delta == 0).all(1) on wide rows
    return ~(delta if delta.dim() == 2 else delta.flatten(1)).any(dim=1)


def correct_mask(delta: Tensor, z: Tensor, targets: Optional[Tensor]) -> Tensor:
    """Rows the model classifies correctly, plus zero-gradient rows (free to skip).  Token-shaped heads:
    every sequence (a sequence has no one class; CAPSkip's bound alone decides, docs/rules.md)."""
    if delta.dim() == 3:
        return torch.ones(delta.shape[0], dtype=torch.bool, device=delta.device)
    if targets is None:  # infer_targets inline: a row with a negative entry has its argmin as label (and is
        mn, arg = delta.min(dim=-1)  # not zero); any other row's label is unknown: correct only if zero
        return torch.where(mn < 0, _argmax(z) == arg, zero_rows(delta))
    # an unknown label (-1) never equals an argmax
    return (_argmax(z) == _labels(targets, z.device)) | zero_rows(delta)


def _argmax(z: Tensor) -> Tensor:
    """``z.argmax(dim=1)``: max's indices are the same (the first maximal entry; NaN wins) and run 1.5-3x
    faster on CPU (aten's argmax reduces without vectorising: 0.9 against 0.35 ms at N = 1024, C = 1000)."""
    return z.max(dim=1).indices


def _labels(targets: Tensor, device: torch.device) -> Tensor:
    """``targets`` as int64 on ``device`` (no op where they already are)."""
    if targets.device != device:
        targets = targets.to(device)
    return targets if targets.dtype == torch.long else targets.long()


def sequence_losses(delta: Tensor, z: Tensor, targets: Optional[Tensor]) -> Tensor:
    """(N,) per-sequence loss of token-shaped logits (N, T, C): its tokens' cross-entropy reduced as the
    loss reduces them, over the tokens that count (a label >= 0 and a nonzero delta): 0 for a sequence without
    one (it adds nothing to the loss), NaN for one with a token that has a gradient but no label.

    The reduction is read from delta, ``delta_t = s_t (softmax(z_t) - onehot(y_t))``: ``s_t`` is the
    token's weight in the loss.  One weight for every counted token (a mean or a sum over the batch's
    tokens, Hugging Face's causal-LM loss): the sum of the sequence's token losses; weights that differ
    between sequences (a mean per sequence, then over the batch): the mean over its tokens.
    """
    dt = torch.float64 if z.dtype == torch.float64 else torch.float32
    y = infer_targets(delta) if targets is None else targets.to(z.device).long()
    d = delta.to(dt)
    valid = (y >= 0) & (d != 0).any(-1)
    ce = per_example_ce(z.flatten(0, 1), torch.where(valid, y, -1).flatten()).view(y.shape)
    ce = torch.where(valid, ce, torch.zeros_like(ce))
    count = valid.sum(1)
    total = ce.sum(1)
    # the token's weight s_t = -delta[y] / (1 - p_y), read where 1 - p_y is not rounding noise
    p_y = torch.exp(-ce)  # softmax(z)[y] without a second (N, T, C) pass
    d_y = d.gather(-1, y.clamp_min(0)[..., None]).squeeze(-1)
    readable = valid & (1 - p_y > 1e-2)
    s = torch.where(readable, -d_y / (1 - p_y).clamp_min(1e-2), torch.zeros_like(p_y))
    s_max = torch.where(readable, s, torch.full_like(s, -math.inf)).amax()
    s_min = torch.where(readable, s, torch.full_like(s, math.inf)).amin()
    per_sequence = (s_min > 0) & (s_max > s_min * (1 + 1e-3))  # weights differ: a mean per sequence
    loss = torch.where(per_sequence, total / count.clamp_min(1), total)
    # a token with gradient but no label (none given, none inferable) makes its sequence's loss unknown
    unknown = ((y < 0) & (d != 0).any(-1)).any(1)
    return torch.where(unknown, torch.full_like(loss, float("nan")), loss)


def per_example_ce(z: Tensor, targets: Tensor) -> Tensor:
    """Per-example cross-entropy in float32 (float64 for float64 logits); NaN where label unknown."""
    dt = torch.float64 if z.dtype == torch.float64 else torch.float32
    z = z if z.dtype == dt else z.to(dt)
    loss = torch.logsumexp(z, dim=1) - z.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1)
    return torch.where(targets >= 0, loss, math.nan)


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
    d = d.flatten(0, -2) if d.dim() > 2 else d  # token-shaped: one row per token
    den = torch.linalg.vector_norm(d, dim=1).sum()
    return d.sum(1).abs().sum() / den.clamp_min(torch.finfo(d.dtype).tiny)


def softmax_residual_parts(delta: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`softmax_residual`'s numerator and denominator, 0-dim each (the residual is their ratio, 0
    where the denominator is 0): four ops, no conversion of ``delta``."""
    dt = torch.float64 if delta.dtype == torch.float64 else torch.float32
    return (torch.linalg.vector_norm(delta.sum(-1, dtype=dt), 1),
            torch.linalg.vector_norm(delta, dim=-1, dtype=dt).sum())


def bad_targets(targets: Tensor, num_classes: int) -> Tensor:
    """0-dim bool (no sync): some explicit label is outside [-1, C) (-1 = unknown)."""
    return ((targets < -1) | (targets >= num_classes)).any()

"""VCAS's sampling math: inclusion probabilities, the two row samplers, Horvitz-Thompson weights and
the closed-form variance they add.  Torch only; no host sync anywhere here.

- ``soft_topk(a, k)``: ``p_i = min(1, c a_i)`` with ``sum p = k`` (water-filling; variance-minimising).
- ``bernoulli_keep(p)``: independent Bernoulli(``p_i``) keeps, the reference's draw.  Its kept count is
  random, so a gathered backward must read it on the host.
- ``systematic_keep(p, k)``: ``k`` slots holding every kept row, with the same inclusion probabilities ``p_i``
  (randomised systematic sampling: the rows in a random order, one uniform offset, points ``u + j``
  on the cumulated ``p``).  Each row's probability is exactly ``p_i`` (its interval has length
  ``p_i <= 1`` and the points are 1 apart), so the ``1/p`` reweighting stays unbiased; the draws are
  negatively correlated instead of independent, which does not raise the variance above the
  independent draw's closed form in practice (tests/test_vcas_math.py measures both).  The size is
  known on the host: no read.
- ``ht_scale(p, keep)``: ``1/p`` on kept rows, 0 elsewhere; ``closed_form_var(q, p)``: the variance
  independent draws add to a sum of rows with norms ``q``, ``sum (1/p - 1) q^2``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def soft_topk(a: Tensor, k) -> Tensor:
    """Inclusion probabilities ``min(1, c*a)`` with ``sum = min(k, #(a > 0))``; no host sync.

    ``a`` (n,) >= 0; ``k`` a number or 0-d tensor.  Computed in float64.
    """
    a = a.detach().double()
    n = a.shape[0]
    if n == 0:
        return a
    k = torch.as_tensor(k, dtype=torch.float64, device=a.device)
    srt, _ = torch.sort(a, descending=True)
    tail = srt.flip(0).cumsum(0).flip(0)  # tail[j] = sum_{i >= j} srt[i]
    j = torch.arange(n, device=a.device, dtype=torch.float64)
    # j largest clipped to 1: c_j = (k - j) / tail[j], valid when c_j * srt[j] <= 1 (and k > j)
    ok = ((k - j) * srt <= tail) & (k - j > 0) & (srt > 0)
    first = torch.where(ok.any(), ok.to(torch.int8).argmax(), torch.tensor(n - 1, device=a.device))
    c = (k - first.double()) / tail.index_select(0, first.reshape(1)).squeeze(0).clamp_min(1e-300)  # no .item()
    p = torch.clamp(c * a, max=1.0)
    p = torch.where(k >= (a > 0).sum(), (a > 0).double(), p).clamp_min(0.0)  # k <= 0: all zero
    return torch.where(a > 0, p, torch.zeros_like(p))


def vcas_k(frac, n):
    """The reference's integer budget ``int(n * frac)`` (floor; ``n``, ``frac`` >= 0); a number or a
    0-d tensor (no host sync), as ``n`` is."""
    if isinstance(n, Tensor) or isinstance(frac, Tensor):
        return torch.floor(torch.as_tensor(frac, dtype=torch.float64) * torch.as_tensor(n, dtype=torch.float64))
    return math.floor(frac * n)


def sample_probs(a: Tensor, frac, n, cap: Optional[int] = None) -> Tensor:
    """Inclusion probabilities for sampling with budget ``int(n * frac)``, the reference's way:
    ``soft_topk``, except that a budget of 0 samples nothing away (every row with ``a > 0`` kept).
    ``cap``: the budget never exceeds it (a fixed-size draw's slot count; it binds only where ``n``
    exceeds the host's bound on it, or a budget of 0 would keep more rows than ``cap``)."""
    k = vcas_k(frac, n)
    cnt = (a > 0).sum()
    k = torch.where(torch.as_tensor(k, device=a.device) <= 0, cnt.to(torch.float64),
                    torch.as_tensor(k, dtype=torch.float64, device=a.device))
    if cap is not None:
        k = k.clamp(max=cap)
    return soft_topk(a, k)


def bernoulli_keep(p: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """Independent keep-masks with P(keep_i) = p_i (p = 1 always kept, p = 0 never)."""
    u = torch.rand(p.shape, generator=generator, device=p.device, dtype=torch.float64)
    return u < p


def ht_scale(p: Tensor, keep: Tensor) -> Tensor:
    """Horvitz-Thompson weights: 1/p on kept rows, 0 elsewhere."""
    return torch.where(keep, 1.0 / p.clamp_min(1e-300), torch.zeros_like(p))


def closed_form_var(q: Tensor, p: Tensor) -> Tensor:
    """Variance Bernoulli(p) + 1/p reweighting adds to a sum of rows with norms ``q``:
    ``sum (1/p - 1) q^2`` over rows with q > 0 (rows with q = 0 add nothing)."""
    q = q.double()
    pos = q > 0
    return torch.where(pos, (1.0 / p.clamp_min(1e-300) - 1.0) * q * q, torch.zeros_like(q)).sum()




def systematic_keep(p: Tensor, k: int, generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
    """(order, kept): ``order`` (k,) distinct row indices holding every kept row, ``kept`` (k,) whether
    each slot is a kept row (slots beyond ``sum p``, e.g. fewer than ``k`` rows with ``p > 0``, hold
    unkept rows: scale 0).  P(row i kept) = p_i for ``p`` in [0, 1] with ``sum p <= k``; no host sync."""
    n = p.shape[0]
    perm = torch.randperm(n, generator=generator, device=p.device)
    cum = p.double().index_select(0, perm).cumsum(0)
    u = torch.rand((), generator=generator, device=p.device, dtype=torch.float64)
    points = u + torch.arange(k, device=p.device, dtype=torch.float64)
    pos = torch.searchsorted(cum, points, right=True)  # the row whose interval [cum_{i-1}, cum_i) holds the point
    hit = pos < n
    rows = perm.index_select(0, pos.clamp(max=n - 1))
    keep = torch.zeros(n, dtype=torch.int32, device=p.device).index_add_(0, rows, hit.to(torch.int32)) > 0
    order = torch.argsort((~keep).to(torch.int8), stable=True)[:k]
    return order, keep.index_select(0, order)

"""The checks that make a step fall back to dense: non-finite values, labels out of range, and (for rules
that read labels) an unused logits output or a dL/dz no softmax loss gives.  They are built on the device
and read together with the kept count (one host read), or, after a fixed-count step, only when its stats
are asked (:func:`deferred_reason`).  Also the refusal of compiled autograd, which would bypass the rule.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..rules.labels import SOFTMAX_RESIDUAL_TOL, softmax_residual


def head_checks(h: Tensor, z: Tensor, g: Optional[Tensor], targets: Optional[Tensor],
                needs_labels: bool) -> tuple[list[str], Tensor, Optional[Tensor]]:
    """The checks' names and values as one (m,) int64 device tensor (no read); and the labels with
    out-of-range ones as -1 (unknown), so the rule, run before the read, never indexes with them.
    ``g`` None (chosen before an in-graph loss's backward): the finite check reads h and z; a kept row's
    non-finite dL/dz then reaches the gradient as it would in a dense step, a skipped row's is never made."""
    # one reduction per tensor: a NaN or inf anywhere makes its sum non-finite (a sum overflowing float32,
    # ~1e38, would read as non-finite too: a dense step, never a wrong one)
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    total = z.sum(dtype=acc) + h.sum(dtype=acc)
    checks = {"finite": torch.isfinite(total + g.sum(dtype=acc) if g is not None else total)}
    if targets is not None:
        targets = targets.to(z.device)
        if z.dim() == 3:  # token-shaped logits: per-token labels, -100 (cross_entropy's ignore_index) ignored
            targets = torch.where(targets == -100, torch.full_like(targets, -1), targets)
        bad = (targets < -1) | (targets >= z.shape[-1])
        checks["bad_targets"] = bad.any()
        targets = torch.where(bad, torch.full_like(targets, -1), targets)
    if g is not None and g.shape[0] > 0 and needs_labels:
        # an unused 2-D output picked as the logits reads as "every row free": CAPSkip would skip all
        checks["zero"] = (g == 0).all()
        if targets is None:
            checks["not_softmax"] = softmax_residual(g) > SOFTMAX_RESIDUAL_TOL
    return list(checks), torch.stack(list(checks.values())).long(), targets


def fallback_reason(checks: dict, deferred: bool = False) -> Optional[str]:
    """Why the checks make the step fall back, or None.  ``deferred``: a fixed-count step, which ran its
    k rows (no read to go dense): the reason says what happened instead."""
    if not checks["finite"]:
        return ("non-finite logits or gradient: the fixed-count rule's kept rows ran with weight NaN, so "
                "the gradient is non-finite as a dense step's" if deferred else
                "non-finite logits or gradient: selection skipped, dense backward")
    tail = ("The fixed-count rule kept its rows anyway (an uninformed selection)" if deferred else
            "Selection skipped, dense backward")
    if checks.get("zero"):
        return ("dL/dz of the logits output is zero on every row: the loss does not use that output "
                "(another (N, C) Linear output first in a tuple/dict?); pass logits_index= to "
                "capskip_fx.compile. " + tail)
    if checks.get("not_softmax"):
        return ("dL/dz is not the gradient of a softmax loss (its rows don't sum to 0, e.g. MSE on the "
                "logits): labels can't be inferred from it; pass model(x, capskip_targets=y). " + tail)
    return None


def deferred_reason(names: list, flags: Tensor, warn: Callable[[str], None]) -> Callable[[], Optional[str]]:
    """A fixed-count step's fallback reason, read from the device (and warned once) when stats ask for it."""
    def read() -> Optional[str]:
        reason = fallback_reason(dict(zip(names, flags.tolist())), deferred=True)
        if reason is not None:
            warn(reason)
        return reason
    return read


def bad_targets_error(targets: Tensor, classes: int) -> ValueError:
    return ValueError(f"capskip_targets must be class labels in [-1, {classes}) for logits with {classes} "
                      f"classes (-1 = unknown); got values in [{int(targets.min())}, {int(targets.max())}]")


def check_not_compiled_autograd() -> None:
    """Compiled autograd replays the AOT backward graph itself: our backward (and so the rule) would
    never run and the step would silently be dense.  Refuse, at the forward and at the backward."""
    import torch._dynamo.compiled_autograd as ca

    if torch._dynamo.config.compiled_autograd or getattr(ca, "compiled_autograd_enabled", False) \
            or getattr(ca, "in_compiled_autograd_region", False):
        raise RuntimeError(
            "capskip_fx does not support compiled autograd (torch._dynamo.config.compiled_autograd / "
            "torch._dynamo.compiled_autograd.enable): its traced backward cannot see which rows a step "
            "keeps. Turn compiled autograd off for models compiled with capskip_fx.")

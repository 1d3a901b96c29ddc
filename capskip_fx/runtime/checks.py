"""The checks that make a step fall back to dense: non-finite values, labels out of range, and (for rules
that read labels) an unused logits output or a dL/dz no softmax loss gives.  They are built on the device
and read together with the kept count (one host read), or, after a fixed-count step, only when its stats
are asked (:func:`deferred_reason`).  Also the refusal of compiled autograd, which would bypass the rule.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from ..rules.labels import SOFTMAX_RESIDUAL_TOL, softmax_residual_parts


class HeadChecks:
    """One head step's checks as 0-dim device tensors (``parts``, no read), and the labels the rule may
    index with (out-of-range ones clamped: a step with one raises after the read, its rule state undone).
    The host reads the parts together with the kept count (:meth:`flags` interprets them), or, after a
    fixed-count step, only when its stats are asked (:func:`deferred_reason`).  Few ops: every op here runs
    eagerly on each step (benchmarks/eager_ops.py)."""

    def __init__(self, parts: list, kinds: list, targets: Optional[Tensor], classes: int, dtype: torch.dtype,
                 finite: int):
        self.parts = parts  # 0-dim tensors, in ``kinds`` order
        self.kinds = kinds  # (check name, how many parts it reads)
        self.finite = finite  # the first parts: L1 norms of z, h and g (when given)
        self.targets = targets
        self.classes = classes
        self.tiny = torch.finfo(dtype).tiny

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.kinds]

    def flags(self, values: list) -> dict:
        """The checks (name -> True where it fails, "finite" -> True where it holds) from the parts' values."""
        out, i = {}, 0
        for name, m in self.kinds:
            v, i = values[i:i + m], i + m
            if name == "finite":  # L1 norms: non-finite where an entry is (or a norm overflows: dense, never wrong)
                out[name] = all(math.isfinite(x) for x in v)
            elif name == "bad_targets":  # the labels' (min, max)
                out[name] = v[0] < -1 or v[1] >= self.classes
            elif name == "zero":  # dL/dz's L1 norm (the finite check's last part): a sum of |x|, so no
                out[name] = values[self.finite - 1] == 0  # underflow hides a nonzero entry
            else:  # "not_softmax": softmax_residual's numerator and denominator
                out[name] = v[0] / max(v[1], self.tiny) > SOFTMAX_RESIDUAL_TOL
        return out


def head_checks(h: Tensor, z: Tensor, g: Optional[Tensor], targets: Optional[Tensor],
                needs_labels: bool, classes: Optional[int] = None) -> HeadChecks:
    """The step's checks (no read).  ``g`` None (chosen before an in-graph loss's backward): the finite
    check reads h and z; a kept row's non-finite dL/dz then reaches the gradient as it would in a dense
    step, a skipped row's is never made.  ``classes``: the logits' last size where z is a stand-in for them
    (None: z's)."""
    classes = z.shape[-1] if classes is None else classes
    given = [t for t in (z, h, g) if t is not None]
    acc = torch.float64 if any(t.dtype == torch.float64 for t in given) else torch.float32
    # one op for every tensor's finiteness: the L1 norm is non-finite where an entry is
    parts = list(torch._foreach_norm(given, 1, dtype=acc))
    kinds = [("finite", len(parts))]
    finite = len(parts)
    if targets is not None and targets.numel():
        if targets.device != z.device:
            targets = targets.to(z.device)
        if z.dim() == 3:  # token-shaped logits: per-token labels, -100 (cross_entropy's ignore_index) ignored
            targets = torch.where(targets == -100, -1, targets)
        parts += list(torch.aminmax(targets))
        kinds.append(("bad_targets", 2))
        targets = targets.clamp(-1, classes - 1)  # the rule never indexes with a bad label
    if g is not None and g.shape[0] > 0 and needs_labels:
        # an unused 2-D output picked as the logits reads as "every row free": CAPSkip would skip all
        kinds.append(("zero", 0))
        if targets is None:
            parts += list(softmax_residual_parts(g))
            kinds.append(("not_softmax", 2))
    return HeadChecks(parts, kinds, targets, classes, acc, finite)


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


def deferred_reason(checks: HeadChecks, values: Tensor, warn: Callable[[str], None]) -> Callable[[], Optional[str]]:
    """A fixed-count step's fallback reason, read from the device (``values``: its checks' parts stacked;
    one read) and warned once, when stats ask for it."""
    def read() -> Optional[str]:
        reason = fallback_reason(checks.flags(values.tolist()), deferred=True)
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

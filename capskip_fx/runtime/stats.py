"""What a step and a run report: :class:`StepStats` (one backward), :class:`RunSummary` (the run so far)
and :class:`RunLog` (completed steps summed, with the rate-limited INFO line).

Stats are kept as tensors where reading them would sync the device; ``StepStats.bound`` (and
``fallback`` after a fixed-count step) syncs lazily, only when read.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from torch import Tensor

from ..records import EVERY_ROW_KEPT, STEP_MODES, Fallback, fallback_kind

log = logging.getLogger("capskip_fx")
LOG_EVERY_S = 60.0  # the INFO line for scripts that never call stats(): at most once a minute


@dataclass(repr=False)
class StepStats:
    step: int = 0
    n: int = 0
    kept: int = 0
    rows: int = 0  # rows the backward actually ran on (kept + zero-weight padding)
    _fallback: Optional[str] = None  # see the ``fallback`` property
    variants: int = 0
    selection_ms: float = 0.0
    weight: Optional[Tensor] = None
    vcas: Optional[dict] = None  # with VCAS: probe?, rows per segment, s, rho, nu, (kept, total) per sampled matmul
    forwards: list = field(default_factory=list, repr=False)  # per-forward StepStats when a step had several
    dense: bool = False  # no rule applied this step (every row ran with weight 1)
    provisional: bool = False  # a dense record a head selection of the same backward replaces
    _note: Optional[str] = field(default=None, repr=False)  # see the ``note`` property
    _bound: Optional[Tensor] = field(default=None, repr=False)
    _pending: Optional[Callable[[], Optional[str]]] = field(default=None, repr=False)  # reads the device

    @property
    def fallback(self) -> Optional[Fallback]:
        """Why something prevented the rule's intent this step (a ``str`` with a ``.kind``,
        ``capskip_fx.records.RefusalKind``); None if nothing did.  A kept share above ``gather_below`` is
        no fallback (see ``note``).  After a fixed-count step this reads the device once (its checks
        were not read at the step)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._fallback = self._fallback or pending()
        reason = self._fallback if self._fallback is not None else next(
            (f.fallback for f in self.forwards if f.fallback), None)
        return reason if reason is None or isinstance(reason, Fallback) else Fallback(reason)

    @fallback.setter
    def fallback(self, reason: Optional[str]) -> None:
        self._fallback = reason

    @property
    def note(self) -> Optional[str]:
        """Why all rows ran with no fallback (the kept share above ``gather_below``: by design)."""
        return self._note or next((f.note for f in self.forwards if f.note), None)

    @note.setter
    def note(self, text: Optional[str]) -> None:
        self._note = text

    def add(self, fwd: "StepStats") -> None:
        """Fold one forward's stats into this step's (n, kept, rows add up; weight/bound per forward)."""
        self.forwards.append(fwd)
        self.refresh()

    def refresh(self) -> None:
        fs = self.forwards
        self.n, self.kept, self.rows = (sum(f.n for f in fs), sum(f.kept for f in fs), sum(f.rows for f in fs))
        self.selection_ms = sum(f.selection_ms for f in fs)
        one = fs[0] if len(fs) == 1 else None
        self.weight = one.weight if one else None
        self._bound = one._bound if one else None

    @property
    def mode(self) -> str:
        """``selected`` (the backward ran on the kept rows), ``dense-masked`` (all rows ran, the rule's
        gradient: skipped rows weighted 0) or ``dense`` (the rule was not applied); ``fallback`` says why
        a step was not ``selected``.  ``none``: no backward yet."""
        if self.dense or (self.forwards and all(f.dense for f in self.forwards)):
            return "dense"
        if not self.n:
            return "none"
        return "selected" if self.rows < self.n else "dense-masked"

    @property
    def bound(self) -> float:
        """||S_k|| / ||G|| for capskip (reads the device once); NaN for rules without a bound."""
        return float(self._bound) if self._bound is not None else math.nan

    @property
    def kept_fraction(self) -> float:
        return self.kept / self.n if self.n else math.nan

    def __repr__(self) -> str:
        """The numbers a user looks at (the weight tensor elided; ``.weight`` has it)."""
        parts = [f"step={self.step}", f"mode={self.mode}", f"n={self.n}", f"kept={self.kept}", f"rows={self.rows}"]
        if self._bound is not None:
            parts.append(f"bound={self.bound:.4g}")
        parts += [f"fallback={_plain(self.fallback)!r}", f"variants={self.variants}"]
        if len(self.forwards) > 1:
            parts.append(f"forwards={len(self.forwards)}")
        return f"StepStats({', '.join(parts)})"

    def as_dict(self) -> dict:
        fb = self.fallback
        d = {"step": self.step, "mode": self.mode, "n": self.n, "kept": self.kept, "rows": self.rows,
             "bound": self.bound, "fallback": _plain(fb), "fallback_kind": fb.kind.value if fb else None,
             "note": self.note, "variants": self.variants, "selection_ms": self.selection_ms}
        if len(self.forwards) > 1:
            d["forwards"] = [f.as_dict() for f in self.forwards]
        return d


def _plain(reason: Optional[str]) -> Optional[str]:
    return None if reason is None else str.__str__(reason)


@dataclass
class RunSummary:
    """The run so far, step by step (``capskip_fx.summary(model)``): how many rows were forwarded, kept
    and run by the backward, the steps by mode, and the fallbacks by kind (every kind; the first detail of
    each; per graph in ``report()``).  No device read: a fixed-count step's deferred non-finite check
    counts only once ``stats().fallback`` read it."""

    steps: int = 0
    n: int = 0  # rows forwarded (with a backward)
    kept: int = 0  # rows the rule kept
    rows: int = 0  # rows the backward ran on
    modes: Counter = field(default_factory=Counter)  # selected / dense-masked / dense -> steps
    fallbacks: Counter = field(default_factory=Counter)  # fallback kind (RefusalKind value) -> steps
    details: dict = field(default_factory=dict)  # fallback kind -> the first step's reason text
    all_rows_by_design: int = 0  # dense-masked steps whose kept share was above gather_below (no fallback)
    # dense steps with a note, no fallback, by note (the string backend's static first batch, a batch of 1)
    dense_by_design: Counter = field(default_factory=Counter)
    every_row_kept: int = 0  # dense-masked steps whose rule kept every row (no fallback)

    def add(self, st: "StepStats") -> None:
        if not st.n:
            return
        self.steps += 1
        self.n, self.kept, self.rows = self.n + st.n, self.kept + st.kept, self.rows + st.rows
        self.modes[st.mode] += 1
        reason = st._fallback or next((f._fallback for f in st.forwards if f._fallback), None)
        if reason is not None:
            kind = fallback_kind(reason).value
            self.fallbacks[kind] += 1
            self.details.setdefault(kind, _plain(reason))
        elif st.mode == "dense-masked" and st.note == EVERY_ROW_KEPT:
            self.every_row_kept += 1
        elif st.mode == "dense-masked" and st.note:
            self.all_rows_by_design += 1
        elif st.mode == "dense" and st.note:
            self.dense_by_design[st.note] += 1

    def __add__(self, other: "RunSummary") -> "RunSummary":
        return RunSummary(self.steps + other.steps, self.n + other.n, self.kept + other.kept, self.rows + other.rows,
                          self.modes + other.modes, self.fallbacks + other.fallbacks,
                          {**other.details, **self.details}, self.all_rows_by_design + other.all_rows_by_design,
                          self.dense_by_design + other.dense_by_design, self.every_row_kept + other.every_row_kept)

    @property
    def kept_pct(self) -> float:
        return 100.0 * self.kept / self.n if self.n else math.nan

    @property
    def rows_pct(self) -> float:
        return 100.0 * self.rows / self.n if self.n else math.nan

    #: the fields a trainer's logger gets, always these (a fixed key set)
    LOG_KEYS = ("capskip/kept_pct", "capskip/rows_pct", "capskip/steps_selected", "capskip/steps_dense_masked",
                "capskip/steps_dense", "capskip/fallbacks")

    def as_dict(self) -> dict:
        """Flat, for a trainer's logger: :attr:`LOG_KEYS`, whatever ran."""
        return {"capskip/kept_pct": self.kept_pct, "capskip/rows_pct": self.rows_pct,
                **{f"capskip/steps_{m.replace('-', '_')}": self.modes[m] for m in STEP_MODES},
                "capskip/fallbacks": sum(self.fallbacks.values())}

    def __str__(self) -> str:
        if not self.steps:
            return "capskip_fx: no training step yet (no backward of a forward with grad enabled)"
        modes = ", ".join(f"{m} {self.modes[m]}" for m in STEP_MODES if self.modes[m])
        out = (f"capskip_fx: {_steps(self.steps)}, kept {self.kept_pct:.1f}% of {self.n} rows, backward ran on "
               f"{self.rows_pct:.1f}% ({modes or 'no steps'})")
        if self.every_row_kept:
            out += f"\n  {_steps(self.every_row_kept)} kept every row: all rows ran, nothing to skip (no fallback)"
        if self.all_rows_by_design:
            out += (f"\n  {_steps(self.all_rows_by_design)} kept more than gather_below of the rows: all rows ran, "
                    f"by design (no fallback)")
        for note, c in self.dense_by_design.items():
            out += f"\n  {_steps(c)} ran dense by design (no fallback): {note}"
        for kind, c in sorted(self.fallbacks.items(), key=lambda kc: (-kc[1], kc[0])):
            out += f"\n  {_steps(c)} fell back ({kind}): {self.details.get(kind)}"
        return out


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


class RunLog:
    """Completed steps: summed into ``totals``, and one INFO line per :data:`LOG_EVERY_S` (no device read)."""

    def __init__(self):
        self.totals = RunSummary()
        self._logged_at = -math.inf

    def add(self, st: StepStats) -> None:
        self.totals.add(st)
        now = time.monotonic()
        if st.n and log.isEnabledFor(logging.INFO) and now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            run = self.totals
            log.info("capskip_fx step %d (%s): kept %d/%d rows, backward ran on %d; run: kept %.1f%%, ran %.1f%% "
                     "of rows over %s%s", st.step, st.mode, st.kept, st.n, st.rows, run.kept_pct, run.rows_pct,
                     _steps(run.steps), f"; this step: {st._fallback}" if st._fallback else
                     f"; by design: {st.note}" if st.note else "")

"""Per-model runtime state: the rule, each forward's side inputs and selection, and step stats.

Every forward of the compiled model is a :class:`ForwardContext`, attached to the autograd node of
the logits it returned (the head graph's compiled function); the head graph's backward reads it
from the running node, so it always uses *its own* forward's labels and indices, whatever the order
of forwards and backwards (several forwards per backward, retain_graph, metrics forwards never
back-propagated, two models interleaved).  The context lives exactly as long as that node: no
registry to evict.  The head graph's backward calls :meth:`RuntimeState.select` once per forward.
A step is one autograd backward (graph task): ``stats()`` shows the last one, with its forwards
when there were several.  Stats are kept as tensors where reading them would sync the device;
``StepStats.bound`` (and ``fallback`` after a fixed-count step) syncs lazily, only when read.

Host reads (each stalls an accelerator's queue): a head backward reads the device once (the kept
count k with the fallback checks folded in), or not at all when the rule's Selection carries a
host-known ``count``; a body graph (after a graph break) reads once (runtime/backward.py).
"""
from __future__ import annotations

import atexit
import logging
import math
import sys
import weakref
from collections import Counter
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..rules.base import HeadView, Rule, Selection
from ..rules.labels import SOFTMAX_RESIDUAL_TOL, infer_targets, softmax_residual

log = logging.getLogger("capskip_fx")
LOG_EVERY_S = 60.0  # the INFO line for scripts that never call stats(): at most once a minute


def _f32(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


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
    _bound: Optional[Tensor] = field(default=None, repr=False)
    _pending: Optional[Callable[[], Optional[str]]] = field(default=None, repr=False)  # reads the device

    @property
    def fallback(self) -> Optional[str]:
        """Why the step (or part of it) did not run the rule's selection as usual; None if it did.
        After a fixed-count step this reads the device once (its checks were not read at the step)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._fallback = self._fallback or pending()
        if self._fallback is not None:
            return self._fallback
        return next((f.fallback for f in self.forwards if f.fallback), None)

    @fallback.setter
    def fallback(self, reason: Optional[str]) -> None:
        self._fallback = reason

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
        parts += [f"fallback={self.fallback!r}", f"variants={self.variants}"]
        if len(self.forwards) > 1:
            parts.append(f"forwards={len(self.forwards)}")
        return f"StepStats({', '.join(parts)})"

    def as_dict(self) -> dict:
        d = {"step": self.step, "mode": self.mode, "n": self.n, "kept": self.kept, "rows": self.rows,
             "bound": self.bound, "fallback": self.fallback, "variants": self.variants,
             "selection_ms": self.selection_ms}
        if len(self.forwards) > 1:
            d["forwards"] = [f.as_dict() for f in self.forwards]
        return d


@dataclass
class RunSummary:
    """The run so far, step by step (``capskip_fx.summary(model)``): how many rows were forwarded, kept
    and run by the backward, the steps by mode, and why steps were not ``selected`` (no device read:
    a fixed-count step's deferred non-finite check counts only once ``stats().fallback`` read it)."""

    steps: int = 0
    n: int = 0  # rows forwarded (with a backward)
    kept: int = 0  # rows the rule kept
    rows: int = 0  # rows the backward ran on
    modes: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)  # reason -> steps

    def add(self, st: "StepStats") -> None:
        if not st.n:
            return
        self.steps += 1
        self.n, self.kept, self.rows = self.n + st.n, self.kept + st.kept, self.rows + st.rows
        self.modes[st.mode] += 1
        reason = st._fallback or next((f._fallback for f in st.forwards if f._fallback), None)
        if reason is not None:
            self.fallbacks[reason] += 1

    def __add__(self, other: "RunSummary") -> "RunSummary":
        return RunSummary(self.steps + other.steps, self.n + other.n, self.kept + other.kept, self.rows + other.rows,
                          self.modes + other.modes, self.fallbacks + other.fallbacks)

    @property
    def kept_pct(self) -> float:
        return 100.0 * self.kept / self.n if self.n else math.nan

    @property
    def rows_pct(self) -> float:
        return 100.0 * self.rows / self.n if self.n else math.nan

    def as_dict(self) -> dict:
        """Flat, for a trainer's logger."""
        d = {"capskip/steps": self.steps, "capskip/kept_pct": self.kept_pct, "capskip/rows_pct": self.rows_pct}
        d.update({f"capskip/steps_{m.replace('-', '_')}": c for m, c in sorted(self.modes.items())})
        return d

    def __str__(self) -> str:
        modes = ", ".join(f"{m} {c}" for m, c in self.modes.most_common())
        out = (f"capskip_fx: {self.steps} steps, kept {self.kept_pct:.1f}% of {self.n} rows, backward ran on "
               f"{self.rows_pct:.1f}% ({modes or 'no steps'})")
        for reason, c in self.fallbacks.most_common(3):
            out += f"\n  {c} steps: {reason}"
        return out


@dataclass(eq=False)
class ForwardContext:
    """One forward of a CapskipModule: its side inputs, and its stats once its head backward ran."""

    targets: Optional[Tensor] = None
    index: Optional[Tensor] = None
    stats: Optional[StepStats] = None


_LIVE: "weakref.WeakSet[RuntimeState]" = weakref.WeakSet()  # states that print their summary at exit


@atexit.register
def _print_summaries() -> None:
    """Unmodified scripts (timm's train.py with backend="capskip") see the run's kept and run fractions."""
    for state in list(_LIVE):
        run = state.summary()
        if run.steps and state.print_at_exit:
            print(str(run), file=sys.stderr)


_CLAIM = object()  # RuntimeState._task: a step recorded at its forward, claimed by the next backward
_ATTR = "_capskip_forward"  # the attribute on the logits' autograd node that holds its ForwardContext


class RuntimeState:
    """Everything one compiled model needs at run time; looked up by ``key`` from the graph."""

    def __init__(self, rule: Rule, seed: int = 0, scope: str = "per_rank"):
        self.rule = rule
        self.scope = scope
        self.step = 0
        self.epoch = 0
        self.seed = seed
        self._generator: Optional[torch.Generator] = None
        self.bound_forwards = False  # CapskipModule binds each forward to its logits' node (and records dense steps)
        self.hook_bound = False  # the string backend's forward hook on the owning module has bound a forward
        self._task: Optional[int] = None  # autograd graph task of the current step
        self._logged_at = -math.inf
        self.last = StepStats()
        self.variants = 0  # compiled selected-row backward variants
        self.masked_reason: Optional[str] = None  # why the head graph's backward runs dense-masked
        self._warned: set[str] = set()
        self.head_bias = True  # set by the graph pass from the head it found
        # backwards with state of their own (VCAS's controllers), in compile order, checkpointed with ours
        self.runners: list = []
        self.totals = RunSummary()  # completed steps (summary() adds the last one)
        self.print_at_exit = False  # the string backend's: scripts that never call stats()
        _LIVE.add(self)
        self._pending_runners: list = []  # their states from a checkpoint loaded before they compiled

    # -- forwards ----------------------------------------------------------------------
    def end_forward(self, fwd: ForwardContext, logits: Any, by_hook: bool = False) -> bool:
        """Bind ``fwd`` to the compiled function that produced the returned logits.  False if there is
        none (the logits come from eager code after the compiled graphs): no graph will select.
        ``by_hook``: the string backend's hook on the model that owns the graphs (backend.py)."""
        if by_hook:
            self.hook_bound = True
        else:
            self.bound_forwards = True
        node = _compiled_node(getattr(logits, "grad_fn", None))
        if node is None:
            return False
        try:
            setattr(node, _ATTR, fwd)
        except (AttributeError, TypeError):
            return False
        return True

    def running_forward(self) -> tuple[bool, Optional[ForwardContext]]:
        """(is this backward the rule's head?, its forward) for the head graph's running backward.

        Bound forwards (CapskipModule): the head is the node a forward bound; a head graph whose node
        is unbound (a Linear output that is not the returned logits) is not.  The string backend binds
        through a forward hook on the module that owns its graphs (from its second forward on)."""
        current = getattr(torch._C, "_current_autograd_node", lambda: None)()
        fwd = getattr(current, _ATTR, None) if current is not None else None
        if fwd is not None:
            return True, fwd
        if self.bound_forwards or self.hook_bound:
            return False, None
        # nothing bound yet (a compiled function, or the first forward of a hooked model): the first head
        # graph of a backward is the logits' (every other compiled graph lies upstream of it), the rest are
        # Linear outputs inside the model: one rule run per backward
        task = getattr(torch._C, "_current_graph_task_id", lambda: -1)()
        return not (task != -1 and task == self._task and bool(self.last.forwards)), None

    @staticmethod
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

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"capskip_fx: {reason}", stacklevel=3)

    # -- the selection ---------------------------------------------------------------
    def select(self, h: Tensor, z: Tensor, g: Tensor, fwd: Optional[ForwardContext]) -> tuple[Tensor, int]:
        """Run the rule on one forward's head.  Returns ``(weight (N,), k)``.  One host read (k with the
        fallback checks), none when the rule's Selection carries a host-known ``count``."""
        t0 = time.perf_counter()
        n = g.shape[0]
        fwd = fwd if fwd is not None else ForwardContext()
        targets = fwd.targets
        if targets is not None and targets.shape[0] != n:
            raise ValueError(f"capskip_targets has {targets.shape[0]} rows but the batch has {n}")
        h, z, g, index, lo = self._global_view(h.detach(), z.detach(), g.detach(), targets, fwd.index)
        if lo is not None:
            targets = self._gathered_targets
        names, flags, safe_targets = self._checks(h, z, g, targets)
        # The rule runs before the checks are read, so that one read serves both.  A step that falls back
        # (or raises) puts the rule's state back: stateful rules (SB's history, UB's EMA, the generators
        # KABENA and the others draw from) never keep an update from a NaN or unusable step.
        gen = self.generator(g.device)
        saved = self.rule.state_dict(), gen.get_state()
        # selection math in float32 whatever the autocast dtype (bf16 Grams/losses are too coarse)
        view = HeadView(delta=_f32(g), h=_f32(h), z=_f32(z), targets=safe_targets, index=index,
                        step=self._peek_step(), epoch=self.epoch, generator=gen, head_bias=self.head_bias)
        sel: Selection = self.rule.select(view) if g.shape[0] > 0 else Selection(weight=g.new_ones(0), count=0)
        weight = sel.weight.to(g.dtype)
        if lo is not None:  # every rank decided over the global batch; keep this rank's rows
            weight = weight[lo:lo + n]
        fallback, pending = None, None
        if sel.count is not None and lo is None and "bad_targets" not in names:
            # the host knows k: no read.  The checks stay on the device: a non-finite step's kept rows
            # weigh NaN, so its gradient is non-finite as a dense step's (GradScaler skips it);
            # stats().fallback reads the checks when asked
            k = sel.count
            weight = torch.where(flags[0].bool() | (weight == 0), weight, torch.full_like(weight, math.nan))
            pending = self._deferred(names, flags)
        else:
            *vals, k = torch.cat([flags, (weight != 0).sum().reshape(1)]).tolist()  # the one host read
            checks = dict(zip(names, vals))
            fallback = _reason(checks)
            if fallback is not None or checks.get("bad_targets"):
                self.rule.load_state_dict(saved[0])
                gen.set_state(saved[1])
            if checks.get("bad_targets"):
                t = targets.to(g.device)
                raise ValueError(f"capskip_targets must be class labels in [-1, {g.shape[1]}) for logits with "
                                 f"{g.shape[1]} classes (-1 = unknown); got values in "
                                 f"[{int(t.min())}, {int(t.max())}]")
            if fallback is not None:
                self.warn_once(fallback)
                sel = Selection(weight=g.new_ones(n))
                weight, k = sel.weight, n
        step = self._begin_step()
        fwd.stats = StepStats(step=step, n=n, kept=int(k), rows=n, _fallback=fallback, dense=fallback is not None,
                              variants=self.variants, weight=weight.detach(), _bound=sel.bound, _pending=pending,
                              selection_ms=(time.perf_counter() - t0) * 1e3)
        self.last.add(fwd.stats)
        return weight, int(k)

    def select_op(self, h: Tensor, z: Tensor, g: Tensor) -> Tensor:
        """ops.select in a head graph whose backward runs dense-masked (not rewritten): the rule's weight
        for the returned logits, all ones for another Linear output."""
        head, fwd = self.running_forward()
        if not head:
            return g.new_ones(g.shape[0])
        weight, _ = self.select(h, z, g, fwd)
        stats = self.last.forwards[-1]
        stats.fallback = stats.fallback or self.masked_reason
        self.last.refresh()
        return weight

    def _begin_step(self) -> int:
        """The step number of the running backward: a new step per autograd graph task."""
        task = getattr(torch._C, "_current_graph_task_id", lambda: -1)()
        if task == -1 or task != self._task:
            self._task = task
            self._log_step(self.last)
            self.last = StepStats(step=self.step, variants=self.variants)
            self.step += 1
        elif self.last.provisional:  # a graph of this backward recorded it dense before the head ran
            self.last = StepStats(step=self.last.step, variants=self.variants)
        return self.last.step

    def _log_step(self, st: StepStats) -> None:
        """A completed step: into the run summary, and one INFO line per LOG_EVERY_S (no device read)."""
        self.totals.add(st)
        now = time.monotonic()
        if st.n and log.isEnabledFor(logging.INFO) and now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            run = self.totals
            log.info("capskip_fx step %d (%s): kept %d/%d rows, backward ran on %d; run: kept %.1f%%, ran %.1f%% "
                     "of rows over %d steps%s", st.step, st.mode, st.kept, st.n, st.rows, run.kept_pct, run.rows_pct,
                     run.steps, f"; this step: {st._fallback}" if st._fallback else "")

    def summary(self) -> RunSummary:
        """The run so far, the step in progress included."""
        now = RunSummary()
        now.add(self.last)
        return self.totals + now

    def set_rows(self, stats: Optional[StepStats], rows: int, reason: Optional[str] = None) -> None:
        """Rows a head graph's backward ran on, for its forward's stats; ``reason``: why all rows ran."""
        if stats is not None:
            stats.rows = rows
            if reason is not None and rows >= stats.n and stats.kept < stats.n:
                stats.fallback = stats.fallback or reason
            if any(f is stats for f in self.last.forwards):
                self.last.refresh()

    def dense_backward(self, stats: Optional[StepStats], reason: str) -> None:
        """A head backward that runs all rows for ``reason`` (exact): warn once, say so in the stats."""
        self.warn_once(f"{reason} -> dense backward")
        if stats is not None:
            stats.fallback = stats.fallback or reason
            self.last.refresh()

    def _checks(self, h: Tensor, z: Tensor, g: Tensor, targets: Optional[Tensor]):
        """The fallback checks as one (m,) int64 device tensor (no read) and their names; and the labels
        with out-of-range ones as -1 (unknown), so the rule, run before the read, never indexes with them."""
        checks = {"finite": torch.isfinite(g).all() & torch.isfinite(z).all() & torch.isfinite(h).all()}
        if targets is not None:
            targets = targets.to(g.device)
            bad = (targets < -1) | (targets >= g.shape[1])
            checks["bad_targets"] = bad.any()
            targets = torch.where(bad, torch.full_like(targets, -1), targets)
        if g.shape[0] > 0 and self.rule.needs_labels:
            # an unused 2-D output picked as the logits reads as "every row free": CAPSkip would skip all
            checks["zero"] = (g == 0).all()
            if targets is None:
                checks["not_softmax"] = softmax_residual(g) > SOFTMAX_RESIDUAL_TOL
        return list(checks), torch.stack(list(checks.values())).long(), targets

    def _deferred(self, names: list, flags: Tensor) -> Callable[[], Optional[str]]:
        """A fixed-count step's fallback reason, read from the device when stats ask for it."""
        def read() -> Optional[str]:
            reason = _reason(dict(zip(names, flags.tolist())), deferred=True)
            if reason is not None:
                self.warn_once(reason)
            return reason
        return read

    def _peek_step(self) -> int:
        """The step number :meth:`_begin_step` will give the running backward (nothing changes)."""
        task = getattr(torch._C, "_current_graph_task_id", lambda: -1)()
        return self.step if task == -1 or task != self._task else self.last.step

    def _global_view(self, h, z, g, targets, index):
        """scope="global": all-gather the head's tensors (and labels, indices) across ranks."""
        import torch.distributed as dist

        if self.scope != "global" or not (dist.is_available() and dist.is_initialized()) \
                or dist.get_world_size() == 1:
            return h, z, g, index, None
        world, rank, n = dist.get_world_size(), dist.get_rank(), g.shape[0]
        sizes = [torch.zeros(1, dtype=torch.long, device=g.device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([n], device=g.device))
        if any(int(s) != n for s in sizes):
            raise ValueError(f"scope='global' needs the same batch size on every rank, got {[int(s) for s in sizes]}")

        def cat(t):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            return torch.cat(parts)

        # ranks without explicit labels contribute the ones dL/dz implies, so every rank sees one label set
        y = targets if targets is not None else infer_targets(g)
        self._gathered_targets = cat(y.to(g.device).long())
        idx = cat(index.to(g.device)) if index is not None else None
        return cat(h), cat(z), cat(g), idx, rank * n

    def record_dense_step(self, n: int, reason: str, provisional: bool = False, at_forward: bool = False) -> None:
        """Stats for a step whose graph was refused (or that ran eagerly): every row ran, and why.
        ``at_forward``: recorded by a forward hook; the next backward's graphs claim it as their step."""
        self._log_step(self.last)
        self.last = StepStats(step=self.step, n=n, kept=n, rows=n, _fallback=reason, variants=self.variants,
                              dense=True, provisional=provisional)
        self._task = _CLAIM if at_forward else None
        self.step += 1

    def body_backward(self, n: int, no_head: Optional[str] = None) -> None:
        """A body graph's backward.  After the head's (the usual order) nothing to do; first in its backward,
        no rule has run: the step is dense (replaced if a head graph of the same backward selects later)."""
        task = getattr(torch._C, "_current_graph_task_id", lambda: -1)()
        if self._task is _CLAIM:  # the forward hook recorded this step (and why)
            self._task = task
        if (task != -1 and task == self._task) or self.bound_forwards:  # CapskipModule recorded it at its forward
            return
        reason = f"{no_head}: no rule runs, dense backward" if no_head else NO_HEAD_REASON
        self.record_dense_step(n, reason, provisional=True)
        self._task = task

    def record_dense_graph(self, n: int, reason: str) -> None:
        """A refused graph's dense backward (string backend): the step's stats, once per backward, unless
        a selecting graph already recorded this backward."""
        task = getattr(torch._C, "_current_graph_task_id", lambda: -1)()
        if self._task is _CLAIM:
            self._task = task
        if task != -1 and task == self._task:
            self.last.fallback = self.last.fallback or reason
            return
        self.record_dense_step(n, reason, provisional=True)
        self._task = task

    # -- stateful backwards --------------------------------------------------------------
    def add_runner(self, runner) -> None:
        """Register a backward with ``state_dict``/``load_state_dict``; a checkpoint loaded before it was
        compiled restores it now (runners compile in the same order each run)."""
        self.runners.append(runner)
        if len(self.runners) <= len(self._pending_runners):
            runner.load_state_dict(self._pending_runners[len(self.runners) - 1])

    def remove_runner(self, runner) -> None:
        self.runners.remove(runner)

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rule": self.rule.state_dict(), "step": self.step, "epoch": self.epoch,
                "generator": None if self._generator is None else self._generator.get_state(),
                "generator_device": None if self._generator is None else str(self._generator.device),
                "runners": [r.state_dict() for r in self.runners] or list(self._pending_runners)}

    def load_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state.get("rule", {}))
        self.step = state.get("step", 0)
        self.epoch = state.get("epoch", 0)
        self._pending_runners = list(state.get("runners", state.get("vcas", [])))  # "vcas": older checkpoints
        for r, st in zip(self.runners, self._pending_runners):
            r.load_state_dict(st)
        if state.get("generator") is not None:
            self._generator = torch.Generator(device=state.get("generator_device") or "cpu")
            self._generator.set_state(state["generator"])


NO_HEAD_REASON = ("no graph of this backward ran the rule (the first step of a model compiled in place or "
                  "per block binds its logits from the second step on; or the logits come from eager code): "
                  "dense backward")
UNBOUND_REASON = ("the returned logits are not the output of a compiled graph (eager code after a graph "
                  "break, or a head left out of a regional compile?): no rule runs, dense backward")


def logits_of(out: Any, index: Optional[int]) -> Optional[Tensor]:
    """The logits among a model's outputs: the tensor itself, the ``index``-th value of a tuple/list/dict,
    else the first 2-D tensor (a Hugging Face ModelOutput's ``logits`` after its 0-d ``loss``)."""
    if isinstance(out, Tensor):
        return out
    vals = list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, (tuple, list)) else []
    if index is not None and index < len(vals):
        return vals[index]
    return next((v for v in vals if isinstance(v, Tensor) and v.dim() == 2), None)


def _reason(checks: dict, deferred: bool = False) -> Optional[str]:
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


def _compiled_node(node):
    """The compiled function's autograd node under the views AOTAutograd replays on its outputs."""
    for _ in range(4):
        if node is None or "CompiledFunction" in type(node).__name__:
            break
        nxt = [f for f, _ in node.next_functions if f is not None]
        node = nxt[0] if len(nxt) == 1 else None
    return node

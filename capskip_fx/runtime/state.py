"""Per-model runtime state: the rule (with its generator), each forward's selection, and the runner and
checkpoint bookkeeping; it composes the parts that each do one job:

  forwards.py  each forward's context, bound to its logits' autograd node
  clock.py     which step the running backward belongs to; the step in progress and the run so far
  view.py      the rows the rule decides over: this rank's, or every rank's (``scope="global"``)
  checks.py    what makes a step fall back to dense, read with the kept count
  stats.py     StepStats, RunSummary and the periodic INFO line

The head graph's backward calls :meth:`RuntimeState.select` once per forward.  A step is one autograd
backward (graph task): ``stats()`` shows the last one, with its forwards when there were several.

Host reads (each stalls an accelerator's queue): a head backward reads the device once (the kept
count k with the fallback checks folded in), or not at all when the rule's Selection carries a
host-known ``count``; a body graph (after a graph break) reads once, or not at all when its incoming
gradient is the one a gathered backward returned (runtime/published.py, runtime/backward.py).
"""
from __future__ import annotations

import atexit
import os
import sys
import time
import warnings
import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from ..records import ONE_ROW_NOTE, Fallback, RefusalKind, fallback_kind
from ..rules.base import HeadView, Rule, Selection
from . import forwards
from .checks import bad_targets_error, check_not_compiled_autograd, deferred_reason, fallback_reason, head_checks
from .clock import StepClock, graph_task
from .forwards import (AFTER_HEAD_REASON, BEFORE_HEAD_REASON, HOOK_REASON, NO_HEAD_REASON, OUTSIDE_GRAPH_REASON,
                       UNBOUND_REASON, ForwardContext, logits_of)
from .published import PublishedRows, root_backward_hooks, user_hooks
from .stats import RunSummary, StepStats
from .view import global_view

# names the backend and the API take from here
__all__ = ["RuntimeState", "ForwardContext", "StepStats", "RunSummary", "logits_of", "UNBOUND_REASON",
           "NO_HEAD_REASON"]


def _head_outside_compiled(owner: Any) -> bool:
    """Blocks compiled in place, the model itself not: whether its classifier (``get_classifier()``, else
    the last Linear) lies outside every compiled module, so that its logits come from eager code."""
    from torch._dynamo.eval_frame import OptimizedModule

    if not isinstance(owner, torch.nn.Module) or isinstance(owner, OptimizedModule) or \
            getattr(owner, "_compiled_call_impl", None) is not None:
        return False
    get = getattr(owner, "get_classifier", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Module):
        head = next((m for m in reversed(list(owner.modules())) if isinstance(m, torch.nn.Linear)), None)
    compiled = [m for m in owner.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    return head is not None and bool(compiled) and not any(head is m for c in compiled for m in c.modules())


def _detached(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t`` outside autograd: itself when it already is (a backward's saved tensors: no op to run)."""
    return t.detach() if t is not None and t.requires_grad else t


def _f32(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t


_LIVE: "weakref.WeakSet[RuntimeState]" = weakref.WeakSet()  # states that print their summary at exit


@atexit.register
def _print_summaries() -> None:
    """Unmodified scripts (timm's train.py with backend="capskip") see the run's kept and run fractions."""
    shown = [(state, run) for state in list(_LIVE) for run in (state.summary(),) if run.steps and state.print_at_exit]
    for state, run in shown:
        text = str(run)
        owner = state.published.owner() if len(shown) > 1 and state.published.owner is not None else None
        if owner is not None:  # several models in one process: which one each line is
            text = text.replace("capskip_fx:", f"capskip_fx ({type(getattr(owner, '_orig_mod', owner)).__name__}):", 1)
        print(text, file=sys.stderr)


# steps recorded dense at their forward: no graph selects
_AT_FORWARD = (UNBOUND_REASON, AFTER_HEAD_REASON, OUTSIDE_GRAPH_REASON, BEFORE_HEAD_REASON)


# the running backward's heads, shared by every model's state: (graph task, head nodes, ids of the compiled
# nodes upstream of them, how many heads were walked)
_BACKWARD: list = [(None, [], set(), 0)]


def _end_of_backward() -> None:
    _BACKWARD[0] = (None, [], set(), 0)


#: the folders whose frames a warning skips: this package, torch (Dynamo, autograd) and the standard library
_LIBRARY_DIRS = tuple(os.path.dirname(f) + os.sep for f in (os.path.dirname(__file__), torch.__file__, os.__file__))


def _caller_outside() -> Optional[tuple]:
    """(file, line) of the innermost frame outside capskip_fx, torch and the standard library: the user's code
    that ran the step, where a warning without a graph location should point; None when there is none."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_LIBRARY_DIRS + ("<frozen", "<eval_with_key")):  # FX's generated code too
            return name, frame.f_lineno
        frame = frame.f_back
    return None


class RuntimeState:
    """Everything one compiled model needs at run time; looked up by ``key`` from the graph."""

    check_not_compiled_autograd = staticmethod(check_not_compiled_autograd)

    def __init__(self, rule: Rule, seed: int = 0, scope: str = "per_rank"):
        self.rule = rule
        self.scope = scope
        self.seed = seed
        self.clock = StepClock()
        self._generator: Optional[torch.Generator] = None
        self.bound_forwards = False  # CapskipModule binds each forward to its logits' node (and records dense steps)
        self.hook_bound = False  # the string backend's forward hook on the owning module has bound a forward
        self.variants = 0  # compiled selected-row backward variants
        self.masked_reason: Optional[str] = None  # why the head graph's backward runs dense-masked
        self._warned: set[str] = set()
        self.head_bias = True  # set by the graph pass from the head it found
        # backwards with state of their own (VCAS's controllers), in compile order, checkpointed with ours
        self.runners: list = []
        self.print_at_exit = False  # the string backend's: scripts that never call stats()
        _LIVE.add(self)
        self._pending_runners: list = []  # their states from a checkpoint loaded before they compiled
        self.published = PublishedRows()  # this backward's gathered input gradients, for the body graphs
        self._skipped: tuple = (None, None)  # (the last selection's weight, its rows of weight 0 or None)
        # (graph task, its selecting heads' nodes, the compiled nodes upstream of them, heads walked so far)

    # the clock's numbers and the step in progress, where the API, the backwards and checkpoints read them
    step = property(lambda self: self.clock.step, lambda self, v: setattr(self.clock, "step", v))
    epoch = property(lambda self: self.clock.epoch, lambda self, v: setattr(self.clock, "epoch", v))
    last = property(lambda self: self.clock.last, doc="the step in progress (StepStats)")

    # -- forwards ----------------------------------------------------------------------
    def end_forward(self, fwd: ForwardContext, logits: Any, by_hook: bool = False, out: Any = None) -> bool:
        """Bind ``fwd`` to the compiled function that produced the returned logits.  False if there is
        none (the logits come from eager code after the compiled graphs): no graph will select.
        ``by_hook``: the string backend's hook on the model that owns the graphs (backend.py).  ``out``: the
        forward's outputs; one computed from the logits with a parameter (outputs_after_head) makes the
        step dense, recorded here with the reason."""
        if by_hook:
            self.hook_bound = True
        else:
            self.bound_forwards = True
        if isinstance(logits, Tensor):
            fwd.logits, fwd.logits_version = weakref.ref(logits), logits._version
            fwd.n = int(logits.shape[0]) if logits.dim() else 0
        bound = forwards.bind(fwd, logits)
        if bound and out is not None:
            reason = AFTER_HEAD_REASON if forwards.outputs_after_head(out, logits) else \
                OUTSIDE_GRAPH_REASON if forwards.outputs_outside_graph(out, logits) else \
                BEFORE_HEAD_REASON if forwards.outputs_before_head(out, logits) else None
            if reason is not None:
                fwd.dense_reason = reason
                self.warn_once(reason)
                self.record_dense_step(int(logits.shape[0]), reason, at_forward=True)
        return bound

    def running_forward(self) -> tuple[bool, Optional[ForwardContext]]:
        """(is this backward the rule's head?, its forward) for the head graph's running backward.

        Decided per forward, at its backward.  A node a forward bound (CapskipModule, the string backend's
        hook on the model) is a head.  An unbound one is a head of its own (its own selection) unless it lies
        upstream of a head that already selected in this backward, or of a refused head (refused_backward):
        then it is a Linear output inside that forward (per-layer compile, blocks before a break), a body graph.  Unbound heads are the forwards that ran before the
        model's binding existed (a string backend's first forward: several forwards before the first
        backward each get their own selection) and extra compiled heads (an auxiliary classifier).  Autograd
        runs a node's backward before those of the nodes upstream of it, so the set is complete when read.
        A forward whose logits came from eager code (recorded dense at the forward) selects nothing."""
        fwd = forwards.running_forward()
        node = forwards.current_node()
        if fwd is not None and fwd.dense_reason is None and fwd.stats is None and self._hooked(fwd):
            self._dense_in_backward([fwd], HOOK_REASON, fwd.n)
        if fwd is not None and fwd.dense_reason is not None:  # decided at its forward (outputs_after_head)
            self._heads().append(node)  # the graphs upstream select nothing of their own either
            return False, fwd
        # claim(): the eager-logits step is recorded at the forward (the string backend's hook), for the next
        # backward to take; in_step() alone is False until a graph claims it
        if fwd is None and (self._upstream_of_heads(node) or (self.clock.claim() and self.last.dense
                                                              and not self.last.provisional
                                                              and self.last.fallback in _AT_FORWARD)):
            return False, None
        self._heads().append(node)
        return True, fwd

    def _heads(self) -> list:
        """The nodes of the heads that selected in the running backward, and of its refused heads (kept for
        this backward only), whichever model's state they ran under: a graph compiled with other options
        than the head's (a Linear of a per-layer compile) that lies upstream of it is a body of that head's
        backward, not a head with its own selection."""
        task = graph_task()
        if _BACKWARD[0][0] != task:
            _BACKWARD[0] = (task, [], set(), 0)
            # nodes hold the autograd graph's structure: dropped when this backward ends
            torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward)
        return _BACKWARD[0][1]

    def refused_backward(self) -> bool:
        """A refused graph's backward (dense).  If a forward bound it (it returned that forward's logits), it
        is that forward's head, run dense: counted as a head of this backward, so an unbound graph upstream
        (the blocks before a graph break) selects no rows of its own on a hidden Linear output, and keeps the
        rows that carry gradient.  An unbound refused graph (a loss computed in a graph of its own, after the
        head's) is no head: the head graph upstream of it still selects.  Returns whether a forward bound it."""
        if forwards.running_forward() is not None:
            self._heads().append(forwards.current_node())
            return True
        return False

    def mixing_backward(self, n: int) -> None:
        """A refused graph's backward, a graph whose outputs hold rows it may move or mix (refused: flip(0), a
        centring over the batch, an undeclared Function, a static batch no proof ran on), that returned no
        forward's logits (features past a graph break, on their way to the loss).  The heads
        upstream of it run their backwards after it, and their row weights would land on other rows than the
        loss's: their forwards run dense, recorded with the reason.  Unbound heads upstream become its body."""
        node = forwards.current_node()
        self._heads().append(node)  # as a refused head: an unbound graph upstream selects nothing of its own
        bound = forwards.heads_upstream(node)
        fresh = [f for f in bound if f.dense_reason is None and f.stats is None]
        if fresh:
            self._dense_in_backward(fresh, AFTER_HEAD_REASON, n)

    def _dense_in_backward(self, fwds: list, reason: str, n: int) -> None:
        """Forwards whose heads' backwards, still to run in this backward, must run dense for ``reason``: each
        one more forward of the running backward's step, dense, with the reason."""
        self.warn_once(reason)
        for f in fwds:
            f.dense_reason = reason
            self._add_forward(StepStats(n=f.n or n, kept=f.n or n, rows=f.n or n, _fallback=reason, dense=True,
                                        variants=self.variants))

    def _add_forward(self, one: StepStats) -> None:
        """``one`` (a forward that ran no rule) into the running backward's step: the step another forward's head
        began, or one of its own that a head selecting later in this backward keeps as one of its forwards."""
        if not self.clock.claim():
            self.record_dense_step(one.n, None, provisional=True)
        one.step = self.last.step
        self.last.add(one)

    def _hooked(self, fwd: ForwardContext) -> bool:
        """A backward hook runs on the returned logits' gradient before the head's graph weights its rows: a
        tensor hook on the logits, or a full backward hook on the model or a global one."""
        t = fwd.logits() if fwd.logits is not None else None
        if t is not None and t._backward_hooks and user_hooks(t._backward_hooks):
            return True
        pub = self.published
        return root_backward_hooks(pub.owner() if pub.owner else None, pub.wrapper() if pub.wrapper else None)

    def after_head_backward(self, n: int) -> bool:
        """A body graph's backward that a forward bound (it returned that forward's logits, after the head's
        graph): when it passes gradient to more than the one graph upstream (a learnable logit scale after a
        graph break), the rows the head would select could not weight that gradient.  Then that forward runs
        dense: this graph counts as the backward's (refused) head, so the graphs upstream select no rows of
        their own, and the forward is one dense forward of the step, with the reason (another forward of the
        same backward may still select).  True if so."""
        node = forwards.current_node()
        fwd = forwards.running_forward()
        if fwd is None or not forwards.bypasses_upstream_graph(node):
            return False
        self._heads().append(node)
        if fwd.stats is None:  # dense in every backward through it (retain_graph: each one a step)
            self._dense_in_backward([fwd], fwd.dense_reason or AFTER_HEAD_REASON, n)
        return True

    def _upstream_of_heads(self, node) -> bool:
        """Whether ``node`` lies upstream of a head that selected in this backward (or of a refused head).
        The autograd graph is walked only when an unbound head graph asks (per-layer compile, a first step),
        from the heads not walked yet: a model whose forwards are all bound never walks it."""
        heads = self._heads()
        task, _, upstream, walked = _BACKWARD[0]
        for h in heads[walked:]:
            upstream.update(forwards.upstream_graphs(h))
        _BACKWARD[0] = (task, heads, upstream, len(heads))
        return id(node) in upstream

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def warn_once(self, reason: str, at: Optional[tuple] = None) -> None:
        """Warn about ``reason`` once per model; ``at``: the model's (file, line) it is about, where the warning
        then points (a compile-time refusal's: Dynamo's frames, not the user's, are on the stack)."""
        if reason.startswith("no classifier head"):  # what a graph without a head means for this model
            from ..hf_loss import loss_lookup_warning

            owner = self.published.owner() if self.published.owner else None
            # a Hugging Face loss lookup's graph break (with the fix); a block of a model whose head is eager
            reason = loss_lookup_warning(owner) or (UNBOUND_REASON if _head_outside_compiled(owner) else reason)
        if reason not in self._warned:
            self._warned.add(reason)
            at = at or _caller_outside()
            if at is not None:
                warnings.warn_explicit(f"capskip_fx: {reason}", UserWarning, at[0], at[1], module="capskip_fx")
            else:
                warnings.warn(f"capskip_fx: {reason}", stacklevel=3)

    # -- the selection ---------------------------------------------------------------
    def select(self, h: Tensor, z: Tensor, g: Optional[Tensor], fwd: Optional[ForwardContext],
               targets: Optional[Tensor] = None) -> tuple[Tensor, int]:
        """Run the rule on one forward's head.  Returns ``(weight (N,), k)``.  One host read (k with the
        fallback checks), none when the rule's Selection carries a host-known ``count``.  ``g`` None: dL/dz
        is not computed yet (an in-graph loss whose backward runs on the kept rows): the rule must not read
        it (``Rule.reads_gradient``), and the finite check reads h and z.  ``targets``: the labels the loss
        read (an in-graph cross-entropy's, with its dL/dz derived), used where no ``capskip_targets`` were given."""
        t0 = time.perf_counter()
        n = z.shape[0]
        fwd = fwd if fwd is not None else ForwardContext()
        if fwd.edited_logits(z):
            raise RuntimeError(
                "capskip_fx: the logits the model returned were modified in place before backward(), and the "
                "compiled backward reads that memory (token logits are returned uncopied, docs/limits.md): its "
                "gradients (the loss inside the model) or its selection (a rule that reads the logits) would "
                "follow the edit. Edit a copy instead (logits = out.logits.clone()). Plain torch.compile "
                "(Inductor) uses the edited values of an in-model loss silently")
        if fwd.targets is not None and fwd.targets.shape[0] != n:
            raise ValueError(f"capskip_targets has {fwd.targets.shape[0]} rows but the batch has {n}")
        if fwd.targets is not None and fwd.targets.shape != z.shape[:-1]:
            raise ValueError(f"capskip_targets has shape {tuple(fwd.targets.shape)}; logits of shape {tuple(z.shape)} "
                             f"need one label per {'token (N, T), aligned with the logits' if z.dim() == 3 else 'row (N,)'}")
        # token logits the head graph did not keep (passes/insert_select.py): z is their (N, T, 1) stand-in
        stand_in = g is not None and z.shape[-1] != g.shape[-1]
        if stand_in and self.rule.reads_logits:
            reason = Fallback(
                f"the rule {self.rule.name!r} reads token logits, which this head graph does not keep: it was "
                "compiled for a rule that reads none (Rule.reads_logits), so the step runs dense. Set the rule "
                "before the model's first step, or call torch._dynamo.reset() after setting it",
                RefusalKind.LOGITS_NOT_KEPT)
            self.warn_once(reason)  # every row, the rule not run (nothing of its state changes)
            return self._record_step(fwd, t0, g.new_ones(n), None, n, reason)
        view = global_view(self.scope, _detached(h), _detached(z), _detached(g),
                           fwd.targets if fwd.targets is not None else targets, fwd.index)
        h, z, g, targets = view.h, view.z, view.g, view.targets
        checks = head_checks(h, z, g, targets, self.rule.needs_labels, g.shape[-1] if stand_in else None)
        names, safe_targets = checks.names, checks.targets
        # The rule runs before the checks are read, so that one read serves both.  A step that falls back
        # (or raises) puts the rule's state back: stateful rules (SB's history, UB's EMA, the generators
        # KABENA and the others draw from) never keep an update from a NaN or unusable step.  The step is a
        # transaction of the rule's (Rule.begin_step): undoing costs what the step wrote, not the state's size.
        gen = self.generator(z.device)
        gen_state = gen.get_state()  # a generator's state is small
        self.rule.begin_step()
        # selection math in float32 whatever the autocast dtype (bf16 Grams/losses are too coarse)
        head = HeadView(delta=_f32(g), h=_f32(h), z=_f32(z), targets=safe_targets, index=view.index,
                        step=self.clock.peek(), epoch=self.epoch, generator=gen, head_bias=self.head_bias,
                        logits=not stand_in)
        try:
            sel: Selection = self.rule.select(head) if z.shape[0] > 0 else Selection(weight=z.new_ones(0), count=0)
        except BaseException:
            self.rule.commit_step()  # as before transactions: a raising rule keeps what it changed
            raise
        dtype = (g if g is not None else z).dtype
        weight = view.local_rows(sel.weight if sel.weight.dtype == dtype else sel.weight.to(dtype), n)  # every rank decided over the global batch
        fallback, pending, skipped = None, None, None
        if sel.count is not None and view.lo is None and "bad_targets" not in names:
            # the host knows k: no read.  The checks stay on the device: a non-finite step's kept rows
            # weigh NaN (x + 0 * inf is NaN), so its gradient is non-finite as a dense step's (GradScaler
            # skips it); stats().fallback reads the checks when asked
            k = sel.count
            parts = torch.stack(checks.parts)
            nonfinite = parts.amax()  # finite, or NaN / inf where a check's part is (no sum to overflow)
            if k < n:
                skipped = weight == 0
                weight = torch.where(skipped, weight, weight.add(nonfinite, alpha=0))
            else:
                weight = weight.add(nonfinite, alpha=0)
            pending = deferred_reason(checks, parts, self.warn_once)
        else:
            skipped = weight == 0
            *vals, n_skipped = torch.stack([*checks.parts, skipped.sum()]).tolist()  # the one host read
            k = n - int(n_skipped)
            flags = checks.flags(vals)
            fallback = fallback_reason(flags)
            if fallback is not None or flags.get("bad_targets"):
                self.rule.undo_step()
                gen.set_state(gen_state)
            if flags.get("bad_targets"):
                raise bad_targets_error(targets.to(z.device), checks.classes)
            if fallback is not None:
                self.warn_once(fallback)
                sel = Selection(weight=weight.new_ones(n))  # no bound either
                weight, k, skipped = sel.weight, n, None
        self.rule.commit_step()  # accepted (a step undone above has nothing left to commit)
        return self._record_step(fwd, t0, weight, skipped, int(k), fallback, sel.bound, pending)

    def _record_step(self, fwd: ForwardContext, t0: float, weight: Tensor, skipped: Optional[Tensor], k: int,
                     fallback: Optional[str] = None, bound: Optional[Tensor] = None, pending: Any = None
                     ) -> tuple[Tensor, int]:
        """The selection's result as this forward's step: its stats, and ``(weight, k)``."""
        n = weight.shape[0]
        self._skipped = (weight, skipped)
        fwd.stats = StepStats(step=self.clock.begin(self.variants), n=n, kept=k, rows=n, _fallback=fallback,
                              dense=fallback is not None, variants=self.variants, weight=_detached(weight),
                              _bound=bound, _pending=pending, selection_ms=(time.perf_counter() - t0) * 1e3)
        self.last.add(fwd.stats)
        return weight, k

    def skipped(self, weight: Tensor) -> Tensor:
        """The rows ``weight`` skips (weight 0), as :meth:`select` found them when it returned ``weight``."""
        last, mask = self._skipped
        return mask if last is weight and mask is not None else weight == 0

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

    def summary(self) -> RunSummary:
        """The run so far, the step in progress included."""
        return self.clock.summary()

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

    # -- steps no rule ran in ----------------------------------------------------------
    def record_dense_step(self, n: int, reason: str, provisional: bool = False, at_forward: bool = False) -> None:
        """Stats for a step whose graph was refused (or that ran eagerly): every row ran, and why.
        ``at_forward``: recorded by a forward hook; the next backward's graphs claim it as their step."""
        self.clock.record_dense(n, reason, self.variants, provisional=provisional, at_forward=at_forward)

    def body_backward(self, n: int, no_head: Optional[str] = None) -> None:
        """A body graph's backward.  After the head's (the usual order) nothing to do; first in its backward,
        no rule has run: the step is dense (replaced if a head graph of the same backward selects later)."""
        if self.clock.claim():
            return
        reason = f"{no_head}: no rule runs, dense backward" if no_head else NO_HEAD_REASON
        if self.bound_forwards:  # CapskipModule recorded a forward without a head graph at the forward ...
            node = forwards.current_node()
            if forwards.running_forward() is None or forwards.has_upstream_graph(node):
                return  # ... or a head graph upstream of this one records the step
            # the returned logits' own graph, with no head and no graph upstream (a recompile whose logits
            # the head matcher no longer recognises, a temperature become a graph input): no rule runs
            self.warn_once(reason)
        self.record_dense_step(n, self._eager_head_reason(reason), provisional=True)

    def record_dense_graph(self, n: int, reason: str, head: bool = False) -> None:
        """A refused graph's dense backward (string backend): the step's stats, once per backward, unless
        a selecting graph already recorded this backward.  ``head``: the graph returned its forward's logits."""
        if str(reason) == ONE_ROW_NOTE:  # a batch of 1: dense by design, a note, not a fallback
            if head:
                self.one_row_backward(n, ONE_ROW_NOTE)
            elif not self.clock.claim():
                self.record_dense_step(n, None, provisional=True)
                self.last.note = ONE_ROW_NOTE
            return
        if self.clock.claim():
            # a refused graph says why no rule ran better than a body graph's "no head" (its backward ran first)
            provisional_no_head = self.last.provisional and fallback_kind(self.last._fallback) is RefusalKind.NO_HEAD
            self.last.fallback = reason if provisional_no_head else self.last.fallback or reason
            return
        self.record_dense_step(n, self._eager_head_reason(reason), provisional=True)

    def one_row_forward(self, logits: Any, note: str) -> None:
        """A training forward of one row that ran no rule (dense by design, ``note``): one more forward of the
        step its backward belongs to (another forward's of the same backward, or a step of its own), counted
        when the gradient reaches its logits.  Logits that take no gradient: a step of its own, now."""
        if isinstance(logits, Tensor) and logits.requires_grad:
            n = int(logits.shape[0]) if logits.dim() else 1
            logits.register_hook(lambda g: self.one_row_backward(n, note))
            return
        self.record_dense_step(1, None)
        self.last.note = note

    def one_row_backward(self, n: int, note: str) -> None:
        """The backward of a one-row forward (see one_row_forward): one more forward of the running backward's
        step, dense by design."""
        one = StepStats(n=n, kept=n, rows=n, dense=True, variants=self.variants)
        one.note = note
        self._add_forward(one)

    def _eager_head_reason(self, reason: str) -> str:
        """A graph with no head, in a model whose head runs outside its compiled blocks: the step's reason is
        the eager head (what the model's forward hook records from its second step on), not the block's."""
        if fallback_kind(reason) is RefusalKind.NO_HEAD and \
                _head_outside_compiled(self.published.owner() if self.published.owner else None):
            return UNBOUND_REASON
        return reason

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
        for i, r in enumerate(self.runners):  # one saved before it existed (before the first step): fresh
            r.load_state_dict(self._pending_runners[i] if i < len(self._pending_runners) else {})
        if state.get("generator") is not None:
            self._generator = torch.Generator(device=state.get("generator_device") or "cpu")
            self._generator.set_state(state["generator"])
        else:  # saved before its first draw: the next draw reseeds with ``seed``, as a fresh run's does
            self._generator = None

"""The executors: one per kind of backward, each carrying out a step's plan (runtime/plan.py) on tensors.

  Gathered      mode "selected": the kept rows gathered, the compiled backward on them, input gradients
                scattered back to N rows
  GatheredInGraph  the same with gather="graph": the compiled twin takes all N rows and the kept-row index
                and gathers inside (Inductor fuses the gathers into their first reads)
  DenseMasked   modes "dense-masked" and "dense": the compiled backward on all N rows with the step's
                weights (a dense step's are all 1)
  Dense         a refused graph's backward (no selection input): plain dense, recorded as the step
  VcasSegments  the compiled backward when it is VCAS's segments, a :class:`SampledBackward` (it registers
                by subclassing): sized by the rows that carry gradient, verified through its exact twin
  Verified      wraps an executor: the same step also run dense-masked, and compared
  LossBackward  an in-graph loss's backward up to dL/dz, run before the rest: on all rows or the kept rows

Every call is boxed (AOTAutograd's convention): a callee clears the argument list it is given.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..records import BackwardMode, Refusal, RefusalKind
from ..rows import gather_all, scatter_rows
from ..symbolic import evaluate

VERIFY = "verify: the gathered backward differs from the dense-masked one; running dense-masked"


class SampledBackward:
    """A compiled backward that samples inside (VCAS's segment runner subclasses it): before each call the
    runtime sets ``live_rows``, the rows that carry gradient; ``exact`` runs the same inputs unsampled."""

    live_rows: Optional[int] = None

    def __call__(self, args: list) -> list:
        raise NotImplementedError

    def exact(self, args: list) -> list:
        raise NotImplementedError


class Compiled:
    """A compiled backward graph as the executors call it; its exact run is the same call."""

    sampled = False

    def __init__(self, fn: Callable):
        self.fn = fn

    def size(self, kept: int) -> None:
        """This call's rows that carry gradient (nothing to size for one graph)."""

    def __call__(self, args: list) -> list:
        return self.fn(args)

    def exact(self, args: list) -> list:
        return self.fn(args)


class VcasSegments(Compiled):
    """VCAS's segments: budgets sized by the rows that carry gradient, rows sampled inside."""

    sampled = True

    def size(self, kept: int) -> None:
        self.fn.live_rows = kept

    def exact(self, args: list) -> list:
        return self.fn.exact(args)


def sizes_at_kept_rows(args: list, specs: list, shapes: list) -> list:
    """``args`` with each size input (a symint spec) replaced by its value at the kept rows; tensors as they are
    (the in-graph gathers take them at all N rows)."""
    return [shape if s.kind == "symint" else a for a, s, shape in zip(args, specs, shapes)]


def compiled_backward(fn: Callable) -> Compiled:
    """The executor of a compiled backward: VCAS's segments where ``fn`` is a SampledBackward."""
    return VcasSegments(fn) if isinstance(fn, SampledBackward) else Compiled(fn)


class RowShapes:
    """Per input, at kb rows: (sizes, strides) of a batch input, the value of a SymInt input, else None.
    Cached per kb: sympy is slow."""

    def __init__(self, specs: list, sym):
        self.specs, self.sym = specs, sym
        self._at: dict[int, list] = {}

    def at(self, kb: int) -> list:
        if kb not in self._at:
            sym = self.sym
            self._at[kb] = [
                (tuple(evaluate(e, sym, kb) for e in s.sizes), tuple(evaluate(e, sym, kb) for e in s.strides))
                if s.kind == "batch" else evaluate(s.expr, sym, kb) if s.kind == "symint" else None
                for s in self.specs]
        return self._at[kb]


class LossBackward:
    """An in-graph loss's backward (the prefix up to dL/dz), run before the rest of the backward.  Its result
    is the rest's inputs: the graph's own inputs the rest takes, then the prefix's outputs."""

    def __init__(self, compiled: Callable, prefix: Any, sym, fused: Optional[Callable] = None):
        self.compiled = compiled
        self.fused = fused  # the same taking all rows and the kept-row index: gathers inside (passes/gather_in_graph.py)
        self.prefix = prefix  # passes.selected_rows.Prefix
        self.shapes = RowShapes(prefix.specs, sym) if prefix.specs is not None else None

    def all_rows(self, full: list) -> list:
        pre = self.prefix
        return [full[i] for i in pre.keep] + list(self.compiled([full[i] for i in pre.args]))

    def kept_rows(self, full: list, idx: torch.Tensor, n: int, fused: bool) -> list:
        """On the ``len(idx)`` kept rows of ``n``, its outputs at those rows; ``fused``: by its twin."""
        pre = self.prefix
        ins = [full[i] for i in pre.args]
        shapes = self.shapes.at(idx.numel())
        if fused:  # the twin gathers its batch inputs itself: they go in at n rows, then the index and n
            ins = sizes_at_kept_rows(ins, pre.specs, shapes) + [idx, n]
            return [full[i] for i in pre.keep] + list(self.fused(ins))
        read = [j for j, s in enumerate(pre.specs) if s.kind == "batch"]
        gathered = iter(gather_all([ins[j] for j in read], [pre.specs[j] for j in read], idx, n,
                                   [shapes[j] for j in read]))
        ins = [next(gathered) if s.kind == "batch" else shape if s.kind == "symint" else a
               for a, s, shape in zip(ins, pre.specs, shapes)]
        return [full[i] for i in pre.keep] + list(self.compiled(ins))


class DenseMasked:
    """All n rows with the step's weights: skipped rows weigh 0, a dense step's weights are all 1."""

    def __init__(self, compiled: Compiled):
        self.compiled = compiled

    def __call__(self, args: list, weight: torch.Tensor) -> list:
        out = self.compiled(args + [weight])
        args.clear()
        return out

    def exact(self, args: list, weight: torch.Tensor) -> list:
        """The same unsampled (verify's reference)."""
        return self.compiled.exact(args + [weight])


class Gathered:
    """The kept rows first (pad rows are skipped rows: weight 0), ``kb`` of them gathered from every batch
    input, the compiled backward run on them, its batch-shaped outputs scattered back to n rows."""

    def __init__(self, compiled: Compiled, plan: Any):
        self.compiled = compiled
        self.plan = plan  # passes.selected_rows.BackwardPlan
        self.shapes = RowShapes(plan.specs, plan.sym)

    def gather(self, args: list, idx: torch.Tensor, n: int, w_kb: torch.Tensor, ready=frozenset()) -> list:
        """The graph's inputs at the ``len(idx)`` kept rows, then their weights; ``ready``: inputs already at
        those rows (a loss backward's outputs on the kept rows).  Clears ``args``."""
        p, kb = self.plan, idx.numel()
        shapes = self.shapes.at(kb)
        read = [i for i, s in enumerate(p.specs) if s.kind == "batch" and i not in p.unread and i not in ready]
        gathered = iter(gather_all([args[i] for i in read], [p.specs[i] for i in read], idx, n,
                                   [shapes[i] for i in read]))
        # an input the graph never reads: its first kb rows, a view (no copy)
        new_args = [a if i in ready else args[i].narrow(s.dim, 0, kb * s.factor) if i in p.unread else
                    next(gathered) if s.kind == "batch" else shape if s.kind == "symint" else a
                    for i, (a, s, shape) in enumerate(zip(args, p.specs, shapes))] + [w_kb]
        args.clear()
        return new_args

    def __call__(self, args: list, idx: torch.Tensor, n: int) -> list:
        """The compiled backward on gathered ``args``; its outputs at n rows."""
        return self._full_rows(self.compiled(args), idx, n)

    def exact(self, args: list, idx: torch.Tensor, n: int) -> list:
        return self._full_rows(self.compiled.exact(args), idx, n)

    def _full_rows(self, outs: list, idx: torch.Tensor, n: int) -> list:
        return [(scatter_rows(o, s, idx, n) if (s is not None and s.kind == "batch" and o is not None) else o)
                for o, s in zip(outs, self.plan.out_specs)]


class GatheredInGraph(Gathered):
    """Gathered, its compiled graph the twin that gathers its own kept rows (passes/gather_in_graph.py): the batch
    inputs go in at n rows, then the kept rows' weights, the index and n."""

    def gather(self, args: list, idx: torch.Tensor, n: int, w_kb: torch.Tensor, ready=frozenset()) -> list:
        assert not ready, "inputs already at the kept rows take the eager gather"
        shapes = self.shapes.at(idx.numel())
        new_args = sizes_at_kept_rows(args, self.plan.specs, shapes) + [w_kb, idx, n]
        args.clear()
        return new_args


class Verified:
    """Wraps an executor (``__call__`` and ``exact`` on the same inputs): its outputs, or for a sampled
    backward its exact twin's on the same rows, compared with the dense-masked backward on all rows.  A step
    whose reference gradients are all zero tells nothing: it does not count as verified.  On a mismatch the
    reference is returned and the graph runs dense-masked from then on (``record.refuse``)."""

    def __init__(self, executor: Any, reference: DenseMasked, record: Any, state: Any):
        self.executor, self.reference, self.record, self.state = executor, reference, record, state

    def __call__(self, args: list, full_args: list, weight: torch.Tensor, stats, *where) -> tuple[list, bool]:
        """(outputs, whether they matched); ``where``: the executor's further arguments (kept rows, n)."""
        again = list(args) if self.executor.compiled.sampled else None
        outs = self.executor(args, *where)
        checked = self.executor.exact(again, *where) if again is not None else outs
        ref = self.reference.exact(full_args, weight)
        rec = self.record
        informative = False
        for o, r in zip(checked, ref):
            if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and r.numel():
                scale = r.double().norm()
                informative = informative or bool(scale > 0)
                tol = 1e-3 if r.dtype in (torch.float32, torch.float64) else 5e-2
                if (o - r).double().norm() > tol * scale + 1e-12:
                    rec.refuse(Refusal(RefusalKind.VERIFY, VERIFY), BackwardMode.DENSE_MASKED)
                    self.state.dense_backward(stats, VERIFY)
                    self.state.set_rows(stats, weight.shape[0])
                    rec.ran("dense-masked", VERIFY)
                    return ref, False
        rec.checks += 1
        rec.verified = rec.verified or informative
        if informative and not bool((weight[:int((weight != 0).sum())] != 0).all()):
            rec.verified_unordered = True
        return outs, True


class Dense:
    """Backward of a refused graph: plain dense; one that returned its forward's logits is that forward's
    head (RuntimeState.refused_backward).  It records the step (n rows, all kept, the reason) in stats()
    without bound forwards (the string backend), and as that head; CapskipModule records at its forward
    where no graph has a head."""

    def __init__(self, compiled, state, reason: Optional[str], batch_arg: Optional[int], record=None,
                 mixes: bool = False):
        self._boxed_call = True
        self.compiled, self.state, self.reason, self.batch_arg = compiled, state, reason, batch_arg
        self.record = record  # the graph's record: report() counts its backwards (steps, last)
        self.mixes = mixes  # refused with rows in its outputs: it may move or mix them (backend._wrap)

    def __call__(self, args):
        head = self.state.refused_backward()
        if not head and self.mixes:
            self.state.mixing_backward(int(args[self.batch_arg].shape[0]) if self.batch_arg is not None else 0)
        # the step: recorded here without bound forwards; with them, here too when this graph returned the logits
        # (CapskipModule records at the forward only where no graph has a head; record_dense_graph keeps that one)
        if (head or not self.state.bound_forwards) and self.batch_arg is not None:
            self.state.record_dense_graph(int(args[self.batch_arg].shape[0]), self.reason, head)
        if self.record is not None:
            self.record.ran("dense", self.reason)
        return self.compiled(args)

    def __getattr__(self, name):
        return getattr(self.compiled, name)


class MaskedInGraph:
    """Backward of a head graph whose rewrite was refused after its selection node went in: the node runs
    inside it at N rows (RuntimeState.select_op) and the rule's weights mask its tangents (dense-masked,
    exact).  Runs as compiled; counts its backwards in the graph's record (report()'s steps and last)."""

    def __init__(self, compiled, record):
        self._boxed_call = True
        self.compiled, self.record = compiled, record

    def __call__(self, args):
        out = self.compiled(args)
        self.record.ran("dense-masked", self.record.reason)
        return out

    def __getattr__(self, name):
        return getattr(self.compiled, name)

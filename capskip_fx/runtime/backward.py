"""The selected-row backward at run time: what AOTAutograd calls as a rewritten graph's backward.

Per call (one backward of one forward):
  - head graph of the returned logits (its autograd node carries its forward, runtime/forwards.py):
    run the rule on that forward's h, z, dL/dz and labels (one host read, none for a fixed count;
    the kept-row index below is built on the device either way);
  - any other graph (graph breaks, DDP splits, regional compile's blocks, a Linear output that is not
    the logits): when its incoming gradient is the very tensor a gathered backward returned (nothing
    between the graphs touched it; runtime/published.py), run on that backward's rows, no host read;
    otherwise drop the rows whose incoming gradient is zero (one host read), exact whatever code lies
    between the graphs (it is not traced, so it is not assumed row-wise);
  - an in-graph loss (the loss computed inside the model): its backward (up to dL/dz) runs first, as its
    own compiled graph: on all rows, and the rows are selected on dL/dz; or, for a rule that reads no dL/dz
    (``Rule.reads_gradient`` False) and a loss backward proven row-wise (passes/prefix_rows.py), the rows
    are selected first and it runs on the kept rows only (``record.prefix_rows`` counts those steps);
  - the kept rows first, ``kb = bucket(k)`` rows gathered (pad rows are skipped rows, weight 0),
    the compiled graph run on them, input gradients scattered back to N rows.
Anything that cannot be shown exact runs the same graph on all N rows (dense-masked), with the
reason recorded on the graph and the step.
Invariant: the returned gradients equal the dense-masked backward's on every call.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..records import BackwardMode, Refusal, RefusalKind
from ..rows import gather_all, scatter_rows
from ..symbolic import evaluate
from .forwards import current_node

VERIFY = "verify: the gathered backward differs from the dense-masked one; running dense-masked"


class SelectedRowBackward:
    """The boxed callable AOTAutograd calls as the backward."""

    def __init__(self, compiled: Callable, plan, state, config, record, dense_only: bool = False,
                 prefix: Optional[Callable] = None, prefix_gathered: Optional[Callable] = None):
        self._boxed_call = True  # instance attr: survives the wrappers AOT puts around us
        self.compiled = compiled
        self.prefix = prefix  # an in-graph loss's backward (dL/dz), run first on all rows
        self.prefix_gathered = prefix_gathered  # the same taking all rows and the kept-row index (fused gathers)
        self.dense_only = dense_only
        self.gathered_steps = 0  # informative gathered steps so far (verify schedule)
        self.plan = plan
        self.state = state
        self.config = config
        self.record = record
        self._shapes: dict[tuple[bool, int], list] = {}

    def _shapes_at(self, kb: int, prefix: bool = False) -> list:
        """Per input (of the prefix: ``prefix``) at kb rows: (sizes, strides) / the SymInt's value / None.
        Cached: sympy is slow."""
        if (prefix, kb) not in self._shapes:
            p = self.plan
            self._shapes[prefix, kb] = [
                (tuple(evaluate(e, p.sym, kb) for e in s.sizes), tuple(evaluate(e, p.sym, kb) for e in s.strides))
                if s.kind == "batch" else evaluate(s.expr, p.sym, kb) if s.kind == "symint" else None
                for s in (p.prefix.specs if prefix else p.specs)]
        return self._shapes[prefix, kb]

    def _chosen_first(self, full: list):
        """(weight, k, stats) when the rows can be chosen before an in-graph loss's backward (it is proven
        row-wise, the rule reads no dL/dz, this is the head of the returned logits), else None."""
        p, state = self.plan, self.state
        keep = p.prefix.keep
        if (p.prefix.specs is None or self.dense_only or not p.head or state.rule.reads_gradient
                or max(p.select_args[:2]) >= len(keep)):
            return None
        head, fwd = state.running_forward()
        if not head:
            return None
        weight, k = state.select(full[keep[p.select_args[0]]], full[keep[p.select_args[1]]], None, fwd)
        return weight, k, state.last.forwards[-1]

    def _prefix_on(self, full: list, idx: Optional[torch.Tensor] = None, n: int = 0) -> list:
        """The rest's inputs: its own (N rows) then the prefix's outputs, the prefix run on all rows or, given
        the kept-row index ``idx`` of ``n`` rows, on those (its outputs at ``len(idx)`` rows)."""
        pre = self.plan.prefix
        ins = [full[i] for i in pre.args]
        if idx is not None:
            shapes = self._shapes_at(idx.numel(), prefix=True)
            if self.prefix_gathered is not None:  # the graph gathers its first reads itself
                ins = [shape if s.kind == "symint" else a for a, s, shape in zip(ins, pre.specs, shapes)] + [idx, n]
                return [full[i] for i in pre.keep] + list(self.prefix_gathered(ins))
            read = [j for j, s in enumerate(pre.specs) if s.kind == "batch"]
            gathered = iter(gather_all([ins[j] for j in read], [pre.specs[j] for j in read], idx, n,
                                       [shapes[j] for j in read]))
            ins = [next(gathered) if s.kind == "batch" else shape if s.kind == "symint" else a
                   for a, s, shape in zip(ins, pre.specs, shapes)]
        return [full[i] for i in pre.keep] + list(self.prefix(ins))

    def _rows_of(self, args: list):
        """(weight, k, this forward's stats or None, the kept-row index or None) for this call: the rule's
        rows (head of the returned logits) or the rows that carry gradient (any other graph)."""
        p, state = self.plan, self.state
        if p.head:
            head, fwd = state.running_forward()
            if head:
                weight, k = state.select(*(args[i] for i in p.select_args), fwd)
                return weight, k, state.last.forwards[-1], None
            if not self.record.body and (state.bound_forwards or state.hook_bound):
                self.record.demoted = "a Linear output that is not the returned logits"
        g = args[p.select_args[-1]]
        n = g.shape[0]
        state.body_backward(n, self.record.no_head)
        tangents = [args[i] for i in p.tangent_args]
        idx = state.published.rows_of(tangents, n, current_node()) if tangents else None
        if idx is not None:  # the consumer's rows, on the device
            self.record.rows_reused += 1
            return torch.zeros(n, dtype=g.dtype, device=g.device).index_fill_(0, idx, 1), idx.numel(), None, idx
        live = torch.zeros(n, dtype=torch.bool, device=g.device)
        for t in tangents:
            live |= (t.reshape(n, -1) != 0).any(1)
        self.record.host_reads += 1
        return live.to(g.dtype), int(live.sum()), None, None  # the one host read of a body graph

    def __call__(self, args: list) -> list:
        p, state, rec = self.plan, self.state, self.record
        state.check_not_compiled_autograd()
        full = None  # the graph's inputs while the loss's backward waits for the rows
        first = self._chosen_first(args) if self.prefix is not None else None
        if first is not None:
            full, args = args, None
            (weight, k, stats), idx = first, None
        else:
            if self.prefix is not None:  # on all rows: the rule reads dL/dz (or the prefix is not row-wise)
                given, args = args, self._prefix_on(args)
                given.clear()
            weight, k, stats, idx = self._rows_of(args)
        n = weight.shape[0]
        if hasattr(self.compiled, "live_rows"):  # a sampling backward (VCAS) sizes its budgets by it
            self.compiled.live_rows = k
        kb = self.config.bucket(k, n)
        if kb > self.config.gather_below * n or self.dense_only:
            # a kept share above gather_below is a mode label (stats().note), not a fallback
            state.set_rows(stats, n, rec.reason if self.dense_only else None)
            rec.ran_all_rows(k, n, self.config.gather_below, stats, state.last)
            if full is not None:
                args = self._prefix_on(full)
                full.clear()
            out = self._dense(list(args), weight)
            args.clear()
            return out
        # kept rows first; the pad rows are skipped rows and carry weight 0
        if idx is None or idx.numel() != kb:
            idx = torch.argsort((weight == 0).to(torch.int8), stable=True)[:kb]
        w_kb = weight.index_select(0, idx)
        check = self._should_verify(k, n)
        ready: frozenset = frozenset()  # the rest's inputs already at kb rows (the prefix's outputs)
        if full is not None:  # the loss's backward on the kept rows; the reference runs it on all rows
            full_args = self._prefix_on(full) if check else None
            args = self._prefix_on(full, idx, n)
            full.clear()
            ready = frozenset(range(len(p.prefix.keep), len(args)))
            rec.prefix_rows += 1
        else:
            full_args = list(args) if check else None
        shapes = self._shapes_at(kb)
        read = [i for i, s in enumerate(p.specs) if s.kind == "batch" and i not in p.unread and i not in ready]
        gathered = iter(gather_all([args[i] for i in read], [p.specs[i] for i in read], idx, n,
                                   [shapes[i] for i in read]))
        # an input the graph never reads: its first kb rows, a view (no copy)
        new_args = [a if i in ready else args[i].narrow(s.dim, 0, kb * s.factor) if i in p.unread else
                    next(gathered) if s.kind == "batch" else shape if s.kind == "symint" else a
                    for i, (a, s, shape) in enumerate(zip(args, p.specs, shapes))] + [w_kb]
        args.clear()
        state.set_rows(stats, kb)
        rec.row_counts.add(kb)
        stochastic = getattr(self.compiled, "stochastic", False)  # VCAS samples inside: verify its exact pass
        check_args = list(new_args) if check and stochastic else None
        outs = self._full_rows(self.compiled(new_args), idx, n)
        if check:
            if stochastic:
                exact = self._full_rows(self.compiled.exact(check_args), idx, n)
                res = self._verify(full_args, weight, exact, stats)
                if res is not exact:
                    return res
            else:
                res = self._verify(full_args, weight, outs, stats)
                if res is not outs:
                    return res
        rec.ran("selected")
        state.published.publish(outs, p.out_specs, idx, n)
        return outs

    def _dense(self, args: list, weight: torch.Tensor, exact: bool = False) -> list:
        """The graph on all n rows with the rule's weights (dense-masked; ``exact``: VCAS's exact pass)."""
        return (getattr(self.compiled, "exact", self.compiled) if exact else self.compiled)(args + [weight])

    def _should_verify(self, k: int, n: int) -> bool:
        """Verify on informative steps only (some rows kept, some dropped): the first one; the next one too
        when the first kept the first k rows (where a value recomputed from the row index coincides with the
        dense one; no read to look for a step that does not: rules that always keep a prefix are served);
        then every ``verify_every`` gathered steps if set."""
        if not self.config.verify or not 0 < k < n:
            return False
        self.gathered_steps += 1
        every = self.config.verify_every
        if not self.record.verified or (not self.record.verified_unordered and self.record.checks < 2):
            return True
        return every is not None and self.gathered_steps % every == 0

    def _full_rows(self, outs: list, idx: torch.Tensor, n: int) -> list:
        """Batch-shaped outputs (input gradients) of the gathered rows back to N rows."""
        return [(scatter_rows(o, s, idx, n) if (s is not None and s.kind == "batch" and o is not None) else o)
                for o, s in zip(outs, self.plan.out_specs)]

    def _verify(self, full_args: list, weight: torch.Tensor, outs: list, stats) -> list:
        """Compare with the same graph on all N rows (dense-masked).  A step whose reference gradients
        are all zero tells nothing: it does not count as verified."""
        ref = self._dense(full_args, weight, exact=True)
        informative = False
        for o, r in zip(outs, ref):
            if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and r.numel():
                scale = r.double().norm()
                informative = informative or bool(scale > 0)
                tol = 1e-3 if r.dtype in (torch.float32, torch.float64) else 5e-2
                if (o - r).double().norm() > tol * scale + 1e-12:
                    self.dense_only = True
                    self.record.refuse(Refusal(RefusalKind.VERIFY, VERIFY), BackwardMode.DENSE_MASKED)
                    self.state.dense_backward(stats, VERIFY)
                    self.state.set_rows(stats, weight.shape[0])
                    self.record.ran("dense-masked", VERIFY)
                    return ref
        self.record.checks += 1
        self.record.verified = self.record.verified or informative
        if informative and not bool((weight[:int((weight != 0).sum())] != 0).all()):
            self.record.verified_unordered = True
        return outs

"""The selected-row backward at run time: what AOTAutograd calls as a rewritten graph's backward.

Per call (one backward of one forward), three parts:
  - the selection: the rows and their weights.
    * head graph of the returned logits (its autograd node carries its forward, runtime/forwards.py): the
      rule on that forward's h, z, dL/dz and labels (one host read, none for a fixed count);
    * any other graph (graph breaks, DDP splits, regional compile's blocks, a Linear output that is not the
      logits): when its incoming gradient is the very tensor a gathered backward returned (nothing between
      the graphs touched it; runtime/published.py), that backward's rows, no host read; otherwise the rows
      whose incoming gradient is nonzero (one host read), exact whatever code lies between the graphs (it
      is not traced, so it is not assumed row-wise);
    * an in-graph loss (computed inside the model): its backward (up to dL/dz) runs first, on all rows, and
      the rule reads its dL/dz; or, when ``plan.rows_before_loss`` allows (a loss backward proven row-wise,
      and a rule that reads no dL/dz or a cross-entropy whose dL/dz runtime/loss_grad.py derives from the
      forward for the rule), the rule chooses first and the loss's backward waits for the rows;
  - the plan (runtime/plan.py, ``plan_step``): from host numbers only, which rows run and how;
  - its executor (runtime/executors.py): the kept rows gathered (``kb = bucket(k)`` rows, pad rows weigh
    0; with gather="graph" by the compiled twin's own reads), the compiled graph run on them, input
    gradients scattered back to N rows; or all N rows with the
    weights (dense-masked: exact, with the reason recorded on the graph and the step); verify wraps it.
Invariant: the returned gradients equal the dense-masked backward's on every call.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .executors import DenseMasked, Gathered, GatheredInGraph, LossBackward, Verified, compiled_backward
from .forwards import current_node
from .loss_grad import derived_grad
from .plan import FUSED, SELECTED, Rows, plan_step, rows_before_loss


class SelectedRowBackward:
    """The boxed callable AOTAutograd calls as the backward."""

    def __init__(self, compiled: Callable, plan, state, config, record, prefix: Optional[Callable] = None,
                 prefix_gathered: Optional[Callable] = None, gathered: Optional[Callable] = None):
        self._boxed_call = True  # instance attr: survives the wrappers AOT puts around us
        self.compiled = compiled_backward(compiled)
        self.gathered = Gathered(self.compiled, plan)
        self.dense_masked = DenseMasked(self.compiled)
        self.verified = Verified(self.gathered, self.dense_masked, record, state)
        # gather="graph": the twin taking all rows and the kept-row index (its gathers fused into its reads)
        self.in_graph = GatheredInGraph(compiled_backward(gathered), plan) if gathered is not None else None
        self.verified_in_graph = (Verified(self.in_graph, self.dense_masked, record, state)
                                  if self.in_graph is not None else None)
        # an in-graph loss's backward (dL/dz); its twin taking all rows and the kept-row index (fused gathers)
        self.loss = LossBackward(prefix, plan.prefix, plan.sym, prefix_gathered) if prefix is not None else None
        self.informative = 0  # informative gathered steps so far (the verify schedule)
        self.plan = plan
        self.state = state
        self.config = config
        self.record = record

    def __call__(self, args: list) -> list:
        state, rec = self.state, self.record
        state.check_not_compiled_autograd()
        waiting = None  # the graph's inputs while the loss's backward waits for the rows
        first = self._chosen_first(args)
        if first is not None:
            waiting, args = args, None
            (weight, k, stats), idx = first, None
        else:
            if self.loss is not None:  # on all rows: the rule reads dL/dz (or the loss backward is not row-wise)
                given, args = args, self.loss.all_rows(args)
                given.clear()
                rec.loss_rows = args[self.plan.select_args[-1]].shape[0]
            weight, k, stats, idx = self._rows_of(args)
        n = weight.shape[0]
        self.compiled.size(k)  # VCAS sizes its budgets by the rows that carry gradient
        own = stats if stats is not None else state.last  # the step a graph that ran no rule belongs to
        dense = own is not None and own.mode == "dense"
        step = plan_step(rec, Rows(n, k, dense, own.fallback if dense else None,
                                   None if idx is None else idx.numel(), waiting is not None),
                         self.config, self.informative, self.loss is not None and self.loss.fused is not None)
        self.informative += step.informative
        if step.mode != SELECTED:
            state.set_rows(stats, n, step.fallback)
            rec.ran(step.mode, step.reason)
            if step.note is not None and stats is not None:
                stats.note = step.note
            if waiting is not None:
                args = self.loss.all_rows(waiting)
                waiting.clear()
                rec.loss_rows = n
            return self.dense_masked(args, weight)
        if not step.reuse:  # kept rows first; the pad rows are skipped rows and carry weight 0
            idx = torch.argsort(state.skipped(weight), stable=True)[:step.rows]
        w_kb = weight.index_select(0, idx)
        ready: frozenset = frozenset()  # the rest's inputs already at kb rows (the loss backward's outputs)
        if waiting is not None:  # the loss's backward on the kept rows; the reference runs it on all rows
            full_args = self.loss.all_rows(waiting) if step.verify else None
            args = self.loss.kept_rows(waiting, idx, n, fused=step.loss_gather == FUSED)
            waiting.clear()
            ready = frozenset(range(len(self.plan.prefix.keep), len(args)))
            rec.prefix_rows += 1
            rec.loss_rows = step.rows
        else:
            full_args = list(args) if step.verify else None
        in_graph = self.in_graph is not None and not ready  # inputs already at the kept rows: the eager gather
        executor = self.in_graph if in_graph else self.gathered
        new_args = executor.gather(args, idx, n, w_kb, ready)
        state.set_rows(stats, step.rows)
        rec.row_counts.add(step.rows)
        rec.graph_gathers += in_graph
        if step.verify:
            outs, matched = (self.verified_in_graph if in_graph else self.verified)(new_args, full_args, weight,
                                                                                   stats, idx, n)
            if not matched:
                return outs
        else:
            outs = executor(new_args, idx, n)
        rec.ran(SELECTED)
        state.published.publish(outs, self.plan.out_specs, idx, n)
        return outs

    def _chosen_first(self, full: list):
        """(weight, k, stats) when the rule chooses before an in-graph loss's backward (plan.rows_before_loss)
        and this backward is its forward's head, else None."""
        p, state = self.plan, self.state
        if self.loss is None or not rows_before_loss(self.record, p, state.rule.reads_gradient):
            return None
        head, fwd = state.running_forward()
        if not head:
            return None
        pre = p.prefix
        h, z = full[pre.keep[p.select_args[0]]], full[pre.keep[p.select_args[1]]]
        if state.rule.reads_gradient:  # dL/dz derived from the forward's values (a recognised cross-entropy)
            g, targets = derived_grad(pre.grad, z, [full[i] for i in pre.grad_args])
            self.record.derived_grads += 1
            weight, k = state.select(h, z, g, fwd, targets)
            if weight.dtype != z.dtype:  # the graph's weight input has the logits' gradient's dtype
                weight = weight.to(z.dtype)
        else:
            weight, k = state.select(h, z, None, fwd)
        return weight, k, state.last.forwards[-1]

    def _rows_of(self, args: list):
        """(weight, k, this forward's stats or None, the kept-row index or None) for this call: the rule's
        rows (head of the returned logits) or the rows that carry gradient (any other graph)."""
        p, state = self.plan, self.state
        if p.head:
            head, fwd = state.running_forward()
            if head:
                weight, k = state.select(*(args[i] for i in p.select_args), fwd)
                return weight, k, state.last.forwards[-1], None
            if fwd is None and not self.record.body and (state.bound_forwards or state.hook_bound):
                self.record.demoted = "a Linear output that is not the returned logits"
        g = args[p.select_args[-1]]
        n = g.shape[0]
        if not p.head and state.after_head_backward(n):  # the returned logits' graph, after the head: dense
            return g.new_ones(n), n, None, None
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

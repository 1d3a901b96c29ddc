"""Joint-graph pass: insert the selection node and mask every batch-shaped tangent.

After this pass the joint graph computes exactly the selected semantics: row i's incoming
gradient is scaled by ``w_i`` (0 = skipped), so the parameter gradients are
``sum_i w_i grad(l_i) / N`` whatever the backward does next.  Masking *every* batch-shaped
tangent (not only the logits') keeps auxiliary outputs of skipped rows out of the gradient.

Graphs without the head (below a graph break, DDPOptimizer's bucket splits) get
``w = capskip::shared(t, key)`` instead: a 0/1 mask of the rows that reach the graph with a nonzero
gradient (its forward's kept rows, when the head's backward ran first), computed at run time from
the incoming gradients themselves, so it changes nothing numerically whatever code lies between
the graphs; it tells the backward pass which rows it may drop.

Invariants: at most one selection node per graph (the pass is idempotent: some torch versions
ran joint pre-passes twice); ``select`` reads ``h``, ``z`` and ``g`` so the partitioner saves
``h`` and ``z``; graphs with cross-example coupling, or with no batch-shaped output, get no node
(dense backward, reason recorded).
"""
from __future__ import annotations

import functools
import pathlib
from typing import Any, Optional

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .. import ops  # noqa: F401  (registers capskip::select)
from ..layout import analyze, backward_nodes
from ..records import BackwardMode, Refused
from ..symbolic import batch_dim, batch_symbol_of, tangent_nodes
from .find_head import find_head, find_in_graph_loss, outputs_and_tangents
from .row_index import recompute_row_indices

aten = torch.ops.aten
SELECT = torch.ops.capskip.select.default
SHARED = torch.ops.capskip.shared.default
SELECTION_OPS = (SELECT, SHARED)


@functools.cache
def source_files() -> tuple[str, ...]:
    """capskip_fx's graph-side sources (everything but the training harness), sorted."""
    root = pathlib.Path(__file__).resolve().parents[1]
    return tuple(str(p) for p in sorted(root.rglob("*.py")) if "train" not in p.relative_to(root).parts)


def _fake_mode(val):
    return getattr(val, "fake_mode", None)


class InsertSelectPass(CustomGraphPass):
    """``joint_custom_pre_pass`` of one ``capskip_fx.compile`` call."""

    def __init__(self, backend: Any):  # the CapskipBackend (duck-typed: passes don't import the backend)
        self.backend = backend

    def uuid(self) -> Optional[bytes]:
        # what Inductor's FX graph cache and AOTAutogradCache key our rewrite on: the source of the code that
        # shapes the graphs, the config and the logits choice.  Not the model's registry key: a compiled graph
        # that calls back into a run-time object (select in a refused backward, VCAS's sampled_wgrad) carries
        # the key as an argument, so the FX graph's own hash tells models apart, and the backend keeps such
        # graphs out of AOTAutogradCache (whose key is Dynamo's graph, before this pass).
        return get_hash_for_files(source_files(),
                                  extra=f"capskip:{self.backend.config}:{getattr(self.backend, 'logits_index', None)}")

    def __call__(self, graph: fx.Graph) -> None:
        if any(n.target in SELECTION_OPS for n in graph.nodes):
            return  # already done: the pass may run twice
        rec = self.backend.current_record()
        if not _tangents(graph):
            rec.backward = BackwardMode.INFERENCE
            return
        if rec.reason is not None:  # refused before AOT (an undeclared custom autograd.Function): dense
            return
        try:
            self._apply(graph, rec)
        except Refused as e:
            rec.refuse(str(e))
            self.backend.on_refused(str(e))

    def _apply(self, graph: fx.Graph, rec) -> None:
        try:
            head = find_head(graph, self.backend.logits_index)
        except Refused as no_head:
            return self._apply_body(graph, rec, str(no_head))
        sym = batch_symbol_of(head.z.meta["val"])
        loss = find_in_graph_loss(graph, head, backward_nodes(graph))
        recompute_row_indices(graph, sym)  # before the proof: the backward must not read arange(N)
        self._check_layout(graph, sym, rec, exclude=loss.nodes if loss else ())
        plan = _batch_tangents(graph, sym)
        if loss is None:
            w = self._insert(graph, head.z, SELECT, (head.h, head.z, head.g, self.backend.key))
        else:  # select on the gradient into the logits, in the backward (runtime: prefix on all rows)
            outs = _output_nodes(graph)
            plan = [t for t, o in zip(*outs) if t in plan and o not in loss.nodes and o is not head.z]
            w = self._insert(graph, loss.grad, SELECT, (head.h, head.z, loss.grad, self.backend.key))
            plan = [loss.grad] + plan
            rec.in_graph_loss = True
        _mask_tangents(graph, w, plan)
        rec.selected = True
        rec.masked_tangents = len(plan)
        self.backend.state.head_bias = head.bias
        graph.lint()

    def _apply_body(self, graph: fx.Graph, rec, no_head: str) -> None:
        tangents = _tangents(graph)
        sym = next((s for s in (_dim0_symbol(t) for t in tangents) if s is not None), None)
        if sym is None:
            raise Refused(no_head)
        self._check_layout(graph, sym, rec)
        plan = _batch_tangents(graph, sym)
        last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
        w = self._insert(graph, last_placeholder, SHARED, (plan[0], self.backend.key))
        _mask_tangents(graph, w, plan)
        rec.body = True
        rec.no_head = no_head
        rec.masked_tangents = len(plan)
        graph.lint()

    def _check_layout(self, graph, sym, rec, exclude=()) -> None:
        """Prove where the batch lies in every forward value (layout.py); refuse row mixing, and saved
        values or outputs whose rows can't be gathered.  The layouts go to the backward pass."""
        result = analyze(graph, sym, exclude)
        rec.layouts = result.layouts
        reason = result.refusal
        if reason is not None:
            if reason.startswith("cross-example"):
                rec.coupled = True
                if self.backend.config.on_coupling == "error":
                    rec.error = f"capskip_fx (on_coupling='error'): {reason}"
            raise Refused(reason)

    def _insert(self, graph: fx.Graph, after: fx.Node, op, args) -> fx.Node:
        vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        with graph.inserting_after(after):
            w = graph.call_function(op, args)
        with _fake_mode(vals[0]):
            w.meta["val"] = op(*vals)
        return w


def _tangents(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in tangent_nodes(graph) if isinstance(n.meta.get("val"), torch.Tensor)]


def _output_nodes(graph: fx.Graph) -> tuple[list, list]:
    """(tangents, the forward outputs they belong to), in order."""
    pairs = [(t, o) for _, o, t in outputs_and_tangents(graph) if t is not None]
    return [t for t, _ in pairs], [o for _, o in pairs]


def _dim0_symbol(t: fx.Node):
    try:
        return batch_symbol_of(t.meta["val"])
    except Refused:
        return None


def _batch_tangents(graph: fx.Graph, sym) -> list[fx.Node]:
    plan = []
    for t in _tangents(graph):
        bd = batch_dim(t.meta["val"].shape, sym)
        if bd is None:
            continue
        if bd != (0, 1):
            raise Refused(f"output tangent {t.name} has its batch in dim {bd[0]} (factor {bd[1]}); "
                          "only outputs with the batch in dim 0 are supported")
        plan.append(t)
    return plan


def _mask_tangents(graph: fx.Graph, w: fx.Node, plan: list[fx.Node]) -> None:
    """t -> t * w (broadcast over non-batch dims) for every batch-shaped tangent."""
    last = w
    for t in plan:
        tval = t.meta["val"]
        shape = [-1] + [1] * (tval.dim() - 1)
        with graph.inserting_after(last):
            wv = graph.call_function(aten.view.default, (w, shape))
        with graph.inserting_after(wv):
            tw = graph.call_function(aten.mul.Tensor, (t, wv))
        with _fake_mode(tval):
            wv.meta["val"] = w.meta["val"].view(shape)
            tw.meta["val"] = tval * wv.meta["val"]
        t.replace_all_uses_with(tw, delete_user_cb=lambda u, w=w, tw=tw: u is not w and u is not tw)
        last = tw

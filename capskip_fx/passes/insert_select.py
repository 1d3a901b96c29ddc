"""Joint-graph pass: insert the selection node and mask every batch-shaped tangent.

After this pass the joint graph computes exactly the selected semantics: row i's incoming
gradient is scaled by ``w_i`` (0 = skipped), so the parameter gradients are
``sum_i w_i grad(l_i) / N`` whatever the backward does next.  Masking *every* batch-shaped
tangent (not only the logits') keeps auxiliary outputs of skipped rows out of the gradient.

Invariants: at most one ``capskip::select`` per graph (the pass is idempotent: some torch
versions ran joint pre-passes twice); the node reads ``h``, ``z`` and ``g`` so the partitioner
saves ``h`` and ``z``; graphs with cross-example coupling or no head get no node (dense).
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Optional

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import ops  # noqa: F401  (registers capskip::select)
from .batch import Refused, batch_dim, batch_symbol_of
from .coupling import find_coupling
from .find_head import find_head

if TYPE_CHECKING:
    from ..backend import CapskipBackend

aten = torch.ops.aten
SELECT = torch.ops.capskip.select.default


def _fake_mode(val):
    return getattr(val, "fake_mode", None)


class InsertSelectPass(CustomGraphPass):
    """``joint_custom_pre_pass`` of one ``capskip_fx.compile`` call."""

    def __init__(self, backend: "CapskipBackend"):
        self.backend = backend

    def uuid(self) -> Optional[bytes]:
        # distinct per compiled model: AOT/FX caches must never serve another config's graph
        return hashlib.sha256(f"capskip:{self.backend.key}:{self.backend.config}".encode()).digest()

    def __call__(self, graph: fx.Graph) -> None:
        if any(n.target == SELECT for n in graph.nodes):
            return
        rec = self.backend.current_record()
        try:
            self._apply(graph, rec)
        except Refused as e:
            rec.refuse(str(e))
            self.backend.on_refused(str(e))

    def _apply(self, graph: fx.Graph, rec) -> None:
        head = find_head(graph, self.backend.logits_index)
        sym = batch_symbol_of(head.z.meta["val"])
        reason = find_coupling(graph, sym)
        if reason is not None:
            rec.coupled = True
            raise Refused(reason)
        tangents = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")
                    and isinstance(n.meta.get("val"), torch.Tensor)]
        plan = []
        for t in tangents:
            bd = batch_dim(t.meta["val"].shape, sym)
            if bd is None:
                continue
            if bd != (0, 1):
                raise Refused(f"output tangent {t.name} has its batch in dim {bd[0]} (factor {bd[1]}); "
                              "only outputs with the batch in dim 0 are supported")
            plan.append(t)

        zval, hval, gval = head.z.meta["val"], head.h.meta["val"], head.g.meta["val"]
        fm = _fake_mode(zval)
        with graph.inserting_after(head.z):
            w = graph.call_function(SELECT, (head.h, head.z, head.g, self.backend.key))
        with fm:
            w.meta["val"] = SELECT(hval, zval, gval, self.backend.key)
        last = w
        for t in plan:
            tval = t.meta["val"]
            shape = [-1] + [1] * (tval.dim() - 1)
            with graph.inserting_after(last):
                wv = graph.call_function(aten.view.default, (w, shape))
            with graph.inserting_after(wv):
                tw = graph.call_function(aten.mul.Tensor, (t, wv))
            with fm:
                wv.meta["val"] = w.meta["val"].view(shape)
                tw.meta["val"] = tval * wv.meta["val"]
            t.replace_all_uses_with(tw, delete_user_cb=lambda u, w=w, tw=tw: u is not w and u is not tw)
            last = tw
        rec.head_bias = head.bias
        rec.selected = True
        rec.masked_tangents = len(plan)
        self.backend.state.head_bias = head.bias
        graph.lint()

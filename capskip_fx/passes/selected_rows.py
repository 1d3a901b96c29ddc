"""Backward-graph pass: run the backward on the kept rows only, reusing the forward's activations.

Given the partitioned backward (symbolic batch ``s``) that contains ``w = capskip::select(h, z, g)``
(head graph) or ``w = capskip::shared(g)`` (body graph):
  1. the node's tensor inputs must be backward inputs (saved activations / tangents); the node
     is replaced by a new last input ``capskip_w``.  At run time the head graph runs the rule
     and publishes its kept rows; body graphs (whose backward runs later) use them.
  2. Every input is classified from its *example input* (real strides from the compiled
     forward, not node meta): no batch / SymInt expression of ``s`` / tensor with one batch dim
     of size ``a*s`` (flattened batch-major when a > 1).  Anything else is refused.
  3. The rewritten graph is compiled ONCE (symbolic batch).  At run time the rule picks the rows,
     the kept rows are moved to the front, ``kb = bucket(k)`` rows are gathered (the pad rows are
     skipped rows with weight 0: exact), SymInt inputs are evaluated at ``kb``, and batch-shaped
     outputs (input gradients) are scattered back to N rows.
Invariants: outputs equal the dense-masked backward's (exact semantics, see insert_select.py);
the compiled graph must not specialise ``s`` (checked after compiling; refused otherwise);
k == N (and kb > gather_below*N) runs ungathered with w masking; k == 0 runs on ``min_rows`` zero-weight rows (zero gradients, not None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import sympy
import torch
from torch import fx

from .batch import Refused, batch_dim, batch_symbol_of, evaluate, expr_of

from .insert_select import SELECT, SELECTION_OPS


@dataclass
class Spec:
    kind: str  # "static" | "symint" | "batch"
    expr: Optional[sympy.Expr] = None
    dim: int = 0
    factor: int = 1
    sizes: tuple = ()
    strides: tuple = ()


def _spec(v: Any, sym: sympy.Symbol) -> Spec:
    if isinstance(v, torch.SymInt):
        e = v.node.expr
        if sym not in e.free_symbols:  # e.g. a dynamic storage offset: its value passes through
            return Spec("static")
        if e.free_symbols != {sym}:
            raise Refused(f"backward input size {e} depends on symbols other than the batch {sym}")
        return Spec("symint", expr=e)
    if isinstance(v, torch.Tensor):
        free = set().union(*(expr_of(s).free_symbols for s in (*v.shape, *v.stride())))
        if not free:
            return Spec("static")
        if free != {sym}:
            raise Refused(f"backward input of shape {tuple(v.shape)} has dynamic dims other than the batch")
        bd = batch_dim(v.shape, sym)
        if bd is None:
            raise Refused(f"backward input of shape {tuple(v.shape)} has the batch only in its strides")
        return Spec("batch", dim=bd[0], factor=bd[1], sizes=tuple(expr_of(s) for s in v.shape),
                    strides=tuple(expr_of(s) for s in v.stride()))
    return Spec("static")


def _conform(x: torch.Tensor, sizes, strides) -> torch.Tensor:
    """``x`` with the exact sizes/strides a compiled graph asserts for this input (a copy if needed)."""
    if tuple(x.shape) == tuple(sizes) and x.stride() == tuple(strides):
        return x
    out = torch.empty_strided(sizes, strides, dtype=x.dtype, device=x.device)
    out.copy_(x)
    return out


def _gather(x: torch.Tensor, spec: Spec, idx: torch.Tensor, n: int, sizes, strides) -> torch.Tensor:
    if spec.factor == 1:
        y = x.index_select(spec.dim, idx)
    else:
        y = x.unflatten(spec.dim, (n, spec.factor)).index_select(spec.dim, idx).flatten(spec.dim, spec.dim + 1)
    return _conform(y, sizes, strides)  # Inductor asserts input strides


def _scatter(y: torch.Tensor, spec: Spec, idx: torch.Tensor, n: int) -> torch.Tensor:
    shape = list(y.shape)
    shape[spec.dim] = n * spec.factor
    full = y.new_zeros(shape)
    if spec.factor == 1:
        full.index_copy_(spec.dim, idx, y)
    else:
        full.unflatten(spec.dim, (n, spec.factor)).index_copy_(
            spec.dim, idx, y.unflatten(spec.dim, (y.shape[spec.dim] // spec.factor, spec.factor)))
    return full


@dataclass
class BackwardPlan:
    """What the rewrite found; kept in the backend's graph record."""

    select_args: tuple[int, ...]  # input positions of h, z, g (head) or g (body)
    specs: list[Spec]
    out_specs: list[Optional[Spec]]
    sym: sympy.Symbol

    @property
    def gathered_inputs(self) -> int:
        return sum(s.kind == "batch" for s in self.specs)


def plan_backward(gm: fx.GraphModule, example_inputs) -> tuple[fx.GraphModule, BackwardPlan, Any]:
    """Rewrite ``gm`` in place (select -> input).  Returns the graph, its plan and the w example."""
    sel = [n for n in gm.graph.nodes if n.target in SELECTION_OPS]
    if len(sel) != 1:
        raise Refused(f"expected one selection node in the backward, found {len(sel)}")
    sel = sel[0]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pos = {n: i for i, n in enumerate(placeholders)}
    tensors = sel.args[:-1]  # (h, z, g) or (g,); the last arg is the state key
    if not all(a in pos for a in tensors):
        raise Refused("the selection's inputs are computed inside the backward (not saved activations)")
    sym = batch_symbol_of(example_inputs[pos[tensors[-1]]])
    specs = [_spec(v, sym) for v in example_inputs]
    for a in tensors:
        if specs[pos[a]].kind != "batch" or specs[pos[a]].factor != 1 or specs[pos[a]].dim != 0:
            raise Refused(f"selection input {a.name} does not carry the batch in dim 0")
    out_vals = list(gm.graph.find_nodes(op="output"))[0].args[0]
    out_specs = []
    for o in out_vals:
        v = o.meta.get("val") if isinstance(o, fx.Node) else None
        out_specs.append(_spec(v, sym) if isinstance(v, torch.Tensor) else None)
        if out_specs[-1] is not None and out_specs[-1].kind == "static":
            out_specs[-1] = None
    w_val = sel.meta["val"]
    with gm.graph.inserting_after(placeholders[-1]):
        w = gm.graph.placeholder("capskip_w")
    w.meta["val"] = w_val
    sel.replace_all_uses_with(w)
    gm.graph.erase_node(sel)
    gm.graph.lint()
    gm.recompile()
    return gm, BackwardPlan(tuple(pos[a] for a in tensors), specs, out_specs, sym), w_val


def check_not_specialised(example_inputs, sym: sympy.Symbol) -> None:
    """Refuse if compiling fixed the batch symbol (the graph would be wrong at other sizes)."""
    fm = next((getattr(v, "fake_mode", None) for v in example_inputs if getattr(v, "fake_mode", None)), None)
    env = getattr(fm, "shape_env", None)
    if env is None:
        return
    rep = env.replacements.get(sym)
    if rep is not None and not rep.free_symbols:
        raise Refused(f"compiling the backward specialised the batch size to {rep}")


class SelectedRowBackward:
    """The boxed callable AOTAutograd calls as the backward."""

    def __init__(self, compiled: Callable, plan: BackwardPlan, state, config, record, dense_only: bool = False):
        self._boxed_call = True  # instance attr: survives the wrappers AOT puts around us
        self.compiled = compiled
        self.dense_only = dense_only
        self.verified = False
        self.plan = plan
        self.state = state
        self.config = config
        self.record = record
        self._layouts: dict[int, list] = {}

    def _layout(self, kb: int) -> list:
        """Per input at kb rows: (sizes, strides) / the SymInt's value / None.  Cached: sympy is slow."""
        if kb not in self._layouts:
            p = self.plan
            self._layouts[kb] = [
                (tuple(evaluate(e, p.sym, kb) for e in s.sizes), tuple(evaluate(e, p.sym, kb) for e in s.strides))
                if s.kind == "batch" else evaluate(s.expr, p.sym, kb) if s.kind == "symint" else None
                for s in p.specs]
        return self._layouts[kb]

    def __call__(self, args: list) -> list:
        p = self.plan
        if len(p.select_args) == 3 and self.state.is_logits_backward():
            # the head graph of the logits the model returned: run the rule, publish the kept rows
            weight, k = self.state.select(*(args[i] for i in p.select_args))
            self.state.publish(weight, k)
        else:  # a body graph, or a Linear output that is not the model's logits (e.g. before a graph break)
            if len(p.select_args) == 3 and not self.record.body:
                self.record.selected, self.record.body = False, True
                self.record.no_head = "a Linear output that is not the returned logits"
            g = args[p.select_args[-1]]
            weight, k = self.state.consume(self.record, g.shape[0], g)
        n = weight.shape[0]
        kb = self.config.bucket(k, n)
        if kb > self.config.gather_below * n or self.dense_only:
            self.state.last.rows = n
            out = self.compiled(list(args) + [weight])
            args.clear()
            return out
        # kept rows first; the pad rows are skipped rows and carry weight 0
        idx = torch.argsort((weight == 0).to(torch.int8), stable=True)[:kb]
        w_kb = weight.index_select(0, idx)
        full_args = list(args) if self.config.verify and not self.verified else None
        new_args = []
        for a, s, lay in zip(args, p.specs, self._layout(kb)):
            if s.kind == "batch":
                new_args.append(_gather(a, s, idx, n, *lay))
            elif s.kind == "symint":
                new_args.append(lay)
            else:
                new_args.append(a)
        args.clear()
        new_args.append(w_kb)
        self.state.last.rows = kb
        self.record.row_counts.add(kb)
        stochastic = getattr(self.compiled, "stochastic", False)  # VCAS samples inside: verify its exact pass
        check_args = list(new_args) if full_args is not None and stochastic else None
        outs = self._scatter_outs(self.compiled(new_args), idx, n)
        if full_args is not None:
            if stochastic:
                exact = self._scatter_outs(self.compiled.exact(check_args), idx, n)
                res = self._verify(full_args, weight, exact)
                return outs if res is exact else res
            outs = self._verify(full_args, weight, outs)
        return outs

    def _scatter_outs(self, outs: list, idx: torch.Tensor, n: int) -> list:
        """Batch-shaped outputs (input gradients) of the gathered rows back to N rows."""
        return [(_scatter(o, s, idx, n) if (s is not None and s.kind == "batch" and o is not None) else o)
                for o, s in zip(outs, self.plan.out_specs)]

    def _verify(self, full_args: list, weight: torch.Tensor, outs: list) -> list:
        """First gathered step: compare with the same graph on all N rows (dense-masked)."""
        self.verified = True
        run = getattr(self.compiled, "exact", self.compiled)
        ref = run(full_args + [weight])
        for o, r in zip(outs, ref):
            if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and r.numel():
                tol = 1e-3 if r.dtype in (torch.float32, torch.float64) else 5e-2
                if (o - r).double().norm() > tol * r.double().norm() + 1e-12:
                    reason = "verify: the gathered backward differs from the dense-masked one; running dense-masked"
                    self.dense_only = True
                    self.record.refuse(reason)
                    self.record.backward = "dense-masked"
                    self.state.fallback = self.state.last.fallback = reason
                    self.state.warn_once(reason)
                    return ref
        return outs

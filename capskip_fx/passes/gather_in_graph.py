"""Backward-graph pass: a proven backward graph that gathers its kept rows itself.  Two users: an in-graph loss's
backward (the prefix up to dL/dz, proven row-wise by passes/prefix_rows.py), and with gather="graph" the
selected backward (proven by passes/validate.py; its last input, the kept rows' weights ``w``, is past the
specs and stays at ``s`` rows).

Input: the graph, every batch input with its spec, its example inputs at ``s`` rows (the kept rows), and
``kept``, the SymInt of ``s``.
Output: the same graph taking its batch inputs at ``n`` rows (a new symbol), plus ``idx`` (``s`` kept-row
indices, int64) and ``n`` as new last inputs, compiled.  Each batch input is indexed (``aten.index``) on its
batch dim (split ``(outer, n, factor)`` when flattened) before its first use, so Inductor fuses the gather
into the first reads: no eager copy of the ``(kept, T, C)`` logits and their tangent, nor of a saved activation
read only by pointwise ops.  Its outputs stay at ``s`` rows (the runtime scatters input gradients back).

Invariants: the gathered values equal what the eager gather (rows.gather_all) passes; the body is unchanged
except that it reads them; every value's meta is re-propagated from the new inputs; a graph that reads an
input's strides (``as_strided``), that Inductor rejects, or that compiling specialised or guarded on ``n``
is refused (the runtime then gathers the rows eagerly).
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import sympy
import torch
from torch import fx

from ..records import RefusalKind, Refused
from ..symbolic import fake_mode_of

aten = torch.ops.aten
N_NAME = "capskip_n"


def compile_gathering(gm: fx.GraphModule, specs: list, sym: sympy.Symbol, example_inputs: list, kept,
                      compile_graph: Callable, kwargs: dict) -> Any:
    """A copy of ``gm`` that gathers its kept rows, compiled with ``compile_graph``; ``gm`` is left as it was.
    Raises Refused."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = fx.GraphModule(gm, graph)
    guards = len(fake_mode_of(example_inputs).shape_env.guards)
    examples, n_sym = gather_rows_in_graph(copy, specs, sym, example_inputs, kept)
    try:
        compiled = compile_graph(copy, examples, **kwargs)
    except Exception as e:  # noqa: BLE001  (our rewrite made a graph Inductor rejects: eager gather)
        raise Refused(f"in-graph gather: compiling failed ({type(e).__name__}: {str(e)[:200]})",
                      RefusalKind.IN_GRAPH_GATHER) from None
    check_full_rows_free(examples, n_sym, guards)
    return compiled


def _stride_readers(gm: fx.GraphModule, batch_nodes: list) -> list:
    """Nodes that read an input's exact strides through views of it (as_strided)."""
    views = (aten.view.default, aten.permute.default, aten.expand.default, aten.slice.Tensor, aten.select.int,
             aten.t.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.alias.default)
    seen, stack, out = set(), list(batch_nodes), []
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.target in (aten.as_strided.default, aten.as_strided_.default):
                out.append(u)
            elif u.target in views and u not in seen:
                seen.add(u)
                stack.append(u)
    return out


def gather_rows_in_graph(gm: fx.GraphModule, specs: list, sym: sympy.Symbol, example_inputs: list,
                         kept: torch.SymInt):
    """Rewrite ``gm`` in place; its inputs' specs ``specs``, ``kept`` the SymInt of ``s``.  Returns the new
    example inputs (``[... full-size batch inputs ..., idx, n]``) and the new symbol.  Raises Refused."""
    fake_mode = fake_mode_of(example_inputs)
    env = getattr(fake_mode, "shape_env", None)
    if env is None:
        raise Refused("in-graph gather: no shape environment to add the full batch symbol to",
                      RefusalKind.IN_GRAPH_GATHER)
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    batch = [(p, s) for p, s in zip(placeholders, specs) if s.kind == "batch"]
    if readers := _stride_readers(gm, [p for p, _ in batch]):
        raise Refused(f"in-graph gather: {readers[0].name} reads a saved input's strides (as_strided)",
                      RefusalKind.IN_GRAPH_GATHER, node=readers[0])
    device = next(v.device for v in example_inputs if isinstance(v, torch.Tensor))
    # a distinct hint: nothing may conflate the full and the kept row counts while compiling
    n_hint = (int(kept.node.hint) if isinstance(kept, torch.SymInt) else int(kept)) + 1
    n_sym = env.create_symbol(n_hint, source=ConstantSource(f"capskip_full_rows_{sym}"),
                              dynamic_dim=DimDynamic.DYNAMIC)
    n_int = env.create_symintnode(n_sym, hint=n_hint)

    def at_n(e: sympy.Expr):
        e = sympy.sympify(e).xreplace({sym: n_sym})
        return int(e) if not e.free_symbols else env.create_symintnode(e, hint=int(e.xreplace({n_sym: n_hint})))

    examples = list(example_inputs)
    with fake_mode:
        for i, (p, s) in enumerate(zip(placeholders, specs)):
            if s.kind == "batch":
                v = example_inputs[i]
                examples[i] = torch.empty_strided([at_n(e) for e in s.sizes], [at_n(e) for e in s.strides],
                                                  dtype=v.dtype, device=v.device, requires_grad=False)
        idx_val = torch.empty(kept, dtype=torch.int64, device=device)
    g = gm.graph
    last = placeholders[-1]
    with g.inserting_after(last):
        n_node = g.placeholder(N_NAME)
    with g.inserting_after(last):
        idx = g.placeholder("capskip_idx")
    n_node.meta["val"], idx.meta["val"] = n_int, idx_val
    with g.inserting_after(n_node):
        k_node = g.call_function(aten.sym_size.int, (idx, 0))
    k_node.meta["val"] = kept
    with g.inserting_before(k_node.next):  # in order, before the body
        for p, s in batch:
            users = list(p.users)
            if s.factor == 1 and s.outer == 1:
                got = g.call_function(aten.index.Tensor, (p, [None] * s.dim + [idx]))
            else:
                at = s.dim + (s.outer != 1)  # the batch axis of the split view
                split = g.call_function(aten.view.default, (p, _with_rows(p, s.dim, _split(s, n_node))))
                sel = g.call_function(aten.index.Tensor, (split, [None] * at + [idx]))
                flat = g.call_function(operator.mul, (k_node, s.factor * s.outer))
                got = g.call_function(aten.view.default, (sel, _with_rows(p, s.dim, [flat])))
            for u in users:
                u.replace_input_with(p, got)
    # the body's views were valid on the saved buffers' strides; the gathered rows are contiguous, so
    # a view may need a copy there (Inductor lowers view and reshape alike; eager graphs copy if needed)
    for v in [n for n in g.nodes if n.target in (aten.view.default, aten._unsafe_view.default)]:
        v.target = aten.reshape.default
    g.lint()
    gm.recompile()
    examples += [idx_val, n_int]
    try:
        FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*examples)
    except Exception as e:  # noqa: BLE001  (any op that cannot take the gathered layout)
        raise Refused(f"in-graph gather: re-propagating shapes failed ({type(e).__name__}: {e})",
                      RefusalKind.IN_GRAPH_GATHER) from None
    return examples, n_sym


def _split(s, rows) -> list:
    """The batch dim's sizes split as ``(outer, rows, factor)``, without an outer or a factor of 1."""
    return ([s.outer] if s.outer != 1 else []) + [rows] + ([s.factor] if s.factor != 1 else [])


def _with_rows(node: fx.Node, dim: int, rows: list) -> list:
    """``node``'s sizes (static but for the batch dim) with its batch dim replaced by ``rows``."""
    shape = list(node.meta["val"].shape)
    return shape[:dim] + rows + shape[dim + 1:]


def check_full_rows_free(example_inputs, n_sym: sympy.Symbol, guards_before: int) -> None:
    """Refuse if compiling fixed the full row count or guarded on it (the graph would be wrong at others)."""
    env = fake_mode_of(example_inputs).shape_env
    if n_sym in env.replacements:
        raise Refused(f"in-graph gather: compiling replaced the full row count by {env.replacements[n_sym]}",
                      RefusalKind.IN_GRAPH_GATHER)
    new = [g.expr for g in env.guards[guards_before:] if n_sym in g.expr.free_symbols]
    if new:
        raise Refused(f"in-graph gather: compiling guarded on the full row count ({new[0]})",
                      RefusalKind.IN_GRAPH_GATHER)

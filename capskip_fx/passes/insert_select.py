"""Joint-graph pass: prove the batch layout, insert the selection node, mask every batch-shaped tangent.

After this pass the joint graph computes exactly the selected semantics: row i's incoming
gradient is scaled by ``w_i`` (0 = skipped), so the parameter gradients are
``sum_i w_i grad(l_i) / N`` whatever the backward does next.  Masking *every* batch-shaped
tangent (not only the logits') keeps auxiliary outputs of skipped rows out of the gradient.

Graphs without the head (below a graph break, DDPOptimizer's bucket splits) get
``w = capskip::shared(t, key)`` instead: a 0/1 mask of the rows that reach the graph with a nonzero
gradient (its forward's kept rows, when the head's backward ran first), computed at run time from
the incoming gradients themselves, so it changes nothing numerically whatever code lies between
the graphs; it tells the backward pass which rows it may drop.

Invariants: at most one selection node per graph (``has_selection``: the pipeline skips a graph that
has one, since some torch versions ran joint pre-passes twice); ``select`` reads ``h``, ``z`` and ``g``
so the partitioner saves ``h`` and ``z``, and the graph returns a copy of ``z`` (``_return_a_copy``:
what the user's code receives is never the saved tensor), except for token-shaped logits (N, T, C), whose
copy would cost a logits' memory.  There, with the loss inside, z is returned as is; with it outside,
through ``_unsafe_view`` (``_return_unaliased``), and a rule that reads none of their values
(``keep_logits`` False) makes ``select`` read a (N, T, 1) stand-in (``_logits_stand_in``) so that z is not
saved either.  Copied still where another op of the graph reads z, whose backward may save it
(``_read_elsewhere``).  Where the backward reads the returned logits' memory, the runtime raises on an
in-place edit of them before it (runtime/state.py).  Graphs with cross-example coupling, or with
no batch-shaped output, get no node (``Refused``: dense backward, reason recorded).  The functions here only rewrite
the graph; ``passes/pipeline.py`` calls them in order and returns what they found.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from .. import ops  # noqa: F401  (registers capskip::select)
from ..placement import analyze
from ..records import RefusalKind, Refused
from ..symbolic import batch_dim, batch_symbol_of, tangent_nodes
from .find_head import Head, outputs_and_tangents
from .in_graph_loss import InGraphLoss

aten = torch.ops.aten
SELECT = torch.ops.capskip.select.default
SHARED = torch.ops.capskip.shared.default
SAVED_COPY = torch.ops.capskip.saved_copy.default
SELECTION_OPS = (SELECT, SHARED)


def has_selection(graph: fx.Graph) -> bool:
    return any(n.target in SELECTION_OPS for n in graph.nodes)


def tangents(graph: fx.Graph) -> list[fx.Node]:
    """The joint graph's tensor tangents (none: an inference graph)."""
    return [n for n in tangent_nodes(graph) if isinstance(n.meta.get("val"), torch.Tensor)]


def prove_layout(graph: fx.Graph, sym, exclude=()) -> dict:
    """Where the batch lies in every forward value (placement/), by value name: what the backward pass
    checks each gathered input against.  Refused for row mixing (CROSS_EXAMPLE), and for saved values
    or outputs whose rows can't be gathered."""
    result = analyze(graph, sym, exclude)
    if result.refusal is not None:
        raise Refused(result.refusal, result.kind or RefusalKind.BATCH_LAYOUT, node=result.node)
    return result.layouts


def select_head(graph: fx.Graph, head: Head, loss: Optional[InGraphLoss], key: int, layouts: dict,
                loss_inputs: Optional[list] = None, keep_logits: bool = True) -> tuple[int, bool]:
    """Insert ``w = select(h, z, g, key)`` (``g``: the gradient into the logits computed in the backward,
    for an in-graph loss), mask the batch-shaped tangents with it and return the logits (a copy, but for token
    logits; its layout added to ``layouts``).  ``loss_inputs``: the graph inputs a recognised cross-entropy's dL/dz is
    derived from (passes/loss_grad.py), read by the node as ``loss=``.  ``keep_logits`` False (the rule reads
    no logits' values, Rule.reads_logits): token-shaped logits with the loss outside are replaced in
    ``select``'s arguments by a stand-in, and neither saved nor copied.  Returns (how many tangents it
    masked, whether the stand-in replaced the logits)."""
    sym = batch_symbol_of(head.z.meta["val"])
    masked = _batch_tangents(graph, sym)
    stand_in = None
    if loss is None and head.tokens is not None and not keep_logits and _vocab(head.z) > 1:
        stand_in = _logits_stand_in(graph, head.z)
        layouts[stand_in.name] = layouts[stand_in.args[0].name] = layouts[head.z.name]  # the batch where z has it
    if loss is None:
        z = head.z if stand_in is None else stand_in
        w = _insert(graph, z, SELECT, (head.h, z, head.g, key), {"loss": []})
    else:  # select on the gradient into the logits, in the backward (runtime: prefix on all rows)
        outs = _output_nodes(graph)
        masked = [t for t, o in zip(*outs) if t in masked and o not in loss.nodes and o is not head.z]
        grad = loss.grad
        if head.tokens is not None:  # (s*T, C): select and mask its (s, T, C) view, the flat users read it back
            grad = _view(graph, loss.grad, [-1] + _sizes(graph, head.z, (1, 2), loss.grad), after=loss.grad)
        w = _insert(graph, grad, SELECT, (head.h, head.z, grad, key),
                    {"loss": list(loss_inputs or [])})
        masked = [grad] + masked
    _mask_tangents(graph, w, masked)
    # a causal LM's (N, T, vocab) logits: a copy costs a logits' memory.  None with the loss inside; with it
    # outside, none unless another op reads z's storage (its backward may save it): select's own read of them
    # (saved z, or the stand-in) is guarded at the backward against an in-place edit (runtime/state.py)
    if head.tokens is None:
        copy = _return_a_copy(graph, head.z)
        layouts[copy.name] = layouts[head.z.name]
    elif loss is None:
        own = stand_in.args[0] if stand_in is not None else w
        back = _return_a_copy if _read_elsewhere(head.z, own) else _return_unaliased
        layouts[back(graph, head.z).name] = layouts[head.z.name]
    if loss is not None and head.tokens is not None:  # the flat gradient's other readers get the masked one
        masked_3d = next(u for u in grad.users if u.target is aten.mul.Tensor)
        flat = _view(graph, masked_3d, [-1] + _sizes(graph, head.z, (2,), masked_3d), after=masked_3d)
        loss.grad.replace_all_uses_with(flat, delete_user_cb=lambda u: u is not grad)
    graph.lint()
    return len(masked), stand_in is not None


def _vocab(z: fx.Node) -> int:
    """The logits' last size; 0 where it is symbolic."""
    c = z.meta["val"].shape[-1]
    return c if isinstance(c, int) else 0


def _logits_stand_in(graph: fx.Graph, z: fx.Node) -> fx.Node:
    """``amax(|z|, -1, keepdim=True)``, (N, T, 1), after ``z``: what ``select`` reads in place of token logits
    whose values the rule never reads.  It keeps their shape's leading dims and their finiteness (|NaN| and
    |inf| carry into the max), at 1/C of their memory; the partitioner saves it, not z (a reduction is not
    recomputed in the backward), so the returned logits are nobody's saved tensor and need no copy."""
    with graph.inserting_after(z):
        a = graph.call_function(aten.abs.default, (z,))
    with graph.inserting_after(a):
        m = graph.call_function(aten.amax.default, (a, [-1], True))
    with z.meta["val"].fake_mode:
        a.meta["val"] = aten.abs.default(z.meta["val"])
        m.meta["val"] = aten.amax.default(a.meta["val"], [-1], True)
    return m


def _aliases(node: fx.Node) -> set:
    """``node``, the base it views and every view of that base: the values that share its storage."""
    def viewing(n):
        return n.op == "call_function" and (getattr(n.target, "is_view", False)
                                            or n.target is aten._unsafe_view.default)

    base = node
    while viewing(base) and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    out, stack = set(), [base]
    while stack:
        n = stack.pop()
        if n not in out:
            out.add(n)
            stack.extend(u for u in n.users if viewing(u))
    return out


def _read_elsewhere(z: fx.Node, own: fx.Node) -> bool:
    """An op other than the output, a view and ``own`` (the stand-in's) reads z or a value sharing its
    storage.  Its backward may save that storage (whether it does, the partitioner decides later), and then
    the returned logits must not share it: ``_unsafe_view`` has its own version counter, so an in-place edit
    of them would change the saved values unseen by autograd."""
    aliases = _aliases(z)
    return any(u.op != "output" and u is not own and u not in aliases for a in aliases for u in a.users)


def _return_unaliased(graph: fx.Graph, z: fx.Node) -> fx.Node:
    """Return the logits through ``aten._unsafe_view`` (no copy): a view of an intermediate (a per-token
    Linear's ``view(addmm)``) that select or its stand-in also reads may reach the user as that view, which autograd
    forbids modifying in place ("Output 0 of CompiledFunction is a view"; torch 2.15, aot_eager).  A plain
    compile's AOTAutograd hides the aliasing the same way (its unsafe_view_alias outputs)."""
    out = graph.output_node()
    sizes = _sizes(graph, z, tuple(range(z.meta["val"].dim())), out)
    with graph.inserting_before(out):
        u = graph.call_function(aten._unsafe_view.default, (z, sizes))
    vals = [s.meta["val"] if isinstance(s, fx.Node) else s for s in sizes]
    with z.meta["val"].fake_mode:
        u.meta["val"] = aten._unsafe_view.default(z.meta["val"], vals)
    out.args = ([u if o is z else o for o in out.args[0]],)
    return u


def _return_a_copy(graph: fx.Graph, z: fx.Node) -> fx.Node:
    """Return a copy of the logits and save ``z`` itself for the selection.  Returned, ``z`` would be a
    user-visible tensor that eager code after the graph may modify in place (a Linear compiled per layer,
    then ``relu(inplace=True)``), and autograd's version check on the saved output would then fail where
    dense saves nothing of it.  A custom op: Inductor removes a plain clone as a no-op."""
    with graph.inserting_after(z):
        c = graph.call_function(SAVED_COPY, (z,))
    with z.meta["val"].fake_mode:
        c.meta["val"] = SAVED_COPY(z.meta["val"])
    out = graph.output_node()  # forward outputs then input gradients, flat: only the former can be z
    out.args = ([c if o is z else o for o in out.args[0]],)
    return c


def fusable_copies(gm: fx.GraphModule) -> int:
    """In a partitioned forward graph, the returned copies of the logits as ``aten.clone``: a kernel the
    compiler fuses, where the custom op is a Python call into eager ops.  Safe after the partition only: the
    saved ``z`` and the copy are then both outputs, and Inductor's no-op removal keeps a clone between two
    outputs (it would fold it into ``z`` in the joint graph).  Returns how many it replaced."""
    copies = list(gm.graph.find_nodes(op="call_function", target=SAVED_COPY))
    for c in copies:
        c.target = aten.clone.default
    if copies:
        gm.recompile()
    return len(copies)


def _sizes(graph: fx.Graph, z: fx.Node, dims: tuple, before: fx.Node) -> list:
    """z's sizes in ``dims``: ints, or sym_size nodes where symbolic (a dynamic sequence length)."""
    out = []
    for d in dims:
        size = z.meta["val"].shape[d]
        if isinstance(size, int):
            out.append(size)
            continue
        with graph.inserting_before(before):
            n = graph.call_function(aten.sym_size.int, (z, d))
        n.meta["val"] = size
        out.append(n)
    return out


def _view(graph: fx.Graph, t: fx.Node, shape: list, after: fx.Node) -> fx.Node:
    with graph.inserting_after(after):
        v = graph.call_function(aten.view.default, (t, shape))
    vals = [s.meta["val"] if isinstance(s, fx.Node) else s for s in shape]
    with t.meta["val"].fake_mode:
        v.meta["val"] = t.meta["val"].view(vals)
    return v


def body_symbol(graph: fx.Graph):
    """The batch symbol of a graph without the head: the first tangent's dim 0, or None."""
    return next((s for s in (_dim0_symbol(t) for t in tangents(graph)) if s is not None), None)


def select_body(graph: fx.Graph, sym, key: int) -> int:
    """Insert ``w = shared(t, key)`` (rows that carry gradient) and mask the batch-shaped tangents."""
    masked = _batch_tangents(graph, sym)
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    w = _insert(graph, last_placeholder, SHARED, (masked[0], key))
    _mask_tangents(graph, w, masked)
    graph.lint()
    return len(masked)


def _insert(graph: fx.Graph, after: fx.Node, op, args, kwargs: Optional[dict] = None) -> fx.Node:
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    kvals = {k: [a.meta["val"] for a in v] for k, v in (kwargs or {}).items()}
    with graph.inserting_after(after):
        w = graph.call_function(op, args, kwargs or {})
    with vals[0].fake_mode:
        w.meta["val"] = op(*vals, **kvals)
    return w


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
    found = []
    for t in tangents(graph):
        bd = batch_dim(t.meta["val"].shape, sym)
        if bd is None:
            continue
        if bd != (0, 1):
            raise Refused(f"output tangent {t.name} has its batch in dim {bd[0]} (factor {bd[1]}); "
                          "only outputs with the batch in dim 0 are supported", RefusalKind.BATCH_LAYOUT)
        found.append(t)
    return found


def _mask_tangents(graph: fx.Graph, w: fx.Node, masked: list[fx.Node]) -> None:
    """t -> t * w (broadcast over non-batch dims) for every batch-shaped tangent."""
    last = w
    for t in masked:
        tval = t.meta["val"]
        shape = [-1] + [1] * (tval.dim() - 1)
        with graph.inserting_after(last):
            wv = graph.call_function(aten.view.default, (w, shape))
        with graph.inserting_after(wv):
            tw = graph.call_function(aten.mul.Tensor, (t, wv))
        with tval.fake_mode:
            wv.meta["val"] = w.meta["val"].view(shape)
            tw.meta["val"] = tval * wv.meta["val"]
        t.replace_all_uses_with(tw, delete_user_cb=lambda u, w=w, tw=tw: u is not w and u is not tw)
        last = tw

"""Backward-graph pass (VCAS SampleA): cut the backward at residual-stream forks into segments.

Which forks: by default one per repeated block, on the block's output, where the reference's
``ActSampler`` sits (:func:`find_blocks`, :func:`block_cuts`); ``VCAS(cut="fork")`` all of them.

A *residual fork* is a gradient value ``b`` with the batch in one dim that feeds a skip ``add``
directly while the add's other summand comes from ``b`` through a matmul (the branch's backward):
a transformer block's residual stream, not the diamonds inside a norm's backward.  ``b`` is a valid cut
when everything below it reads gradients only through it: no batch-shaped gradient value from
outside ``desc(b)`` flows into ``desc(b)`` (non-batch ones, e.g. a tied weight's partial
gradient, may: they are summands the rows don't touch).  Valid cuts found from the graph alone
(no module names) form a chain; the segments between them are compiled separately with the same
symbolic batch, so each can run on its own row count.

Invariants (asserted in tests/test_vcas.py): running the segments in order on all rows, with no
sampling, gives the unsegmented graph's outputs exactly; every node lands in exactly one segment;
a gradient node sits below every cut it descends from; a non-gradient node (recomputed from saved
activations) sits in the first segment that reads it; multi-output nodes stay with their getitems.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import sympy
import torch
from torch import fx

from ..records import RefusalKind, Refused
from ..symbolic import Spec, batch_dim_of, spec_of, tangent_nodes


@dataclass
class Segment:
    gm: fx.GraphModule
    inputs: list  # ("arg", i): backward input i | ("val", name): a value of an earlier segment
    outputs: list[str]  # names of the values it produces for later segments / the final outputs
    boundary: Optional[str] = None  # the cut value this segment starts from (None: the top segment)
    examples: list = field(default_factory=list)


@dataclass
class Segments:
    segments: list[Segment]
    final: list  # per backward output: ("val", name) | ("arg", i) | ("const", value)
    specs: dict  # value name -> Spec (crossing values)
    boundaries: list[str]
    sym: sympy.Symbol

    def __len__(self) -> int:
        return len(self.segments)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


@dataclass
class Flow:
    """Gradient flow of a backward graph: which nodes carry gradient (depend on a tangent) and each
    node's descendants as a bitset over the node order."""

    nodes: list
    idx: dict
    grad: dict
    desc: dict

    @classmethod
    def of(cls, graph: fx.Graph) -> "Flow":
        nodes = list(graph.nodes)
        idx = {n: i for i, n in enumerate(nodes)}
        tangents = set(tangent_nodes(graph))
        grad = {}
        for n in nodes:
            grad[n] = n in tangents or (n.op == "call_function" and any(grad.get(a, False) for a in n.all_input_nodes))
        desc = {}
        for n in reversed(nodes):
            d = 0
            for u in n.users:
                if u.op != "output":
                    d |= (1 << idx[u]) | desc[u]
            desc[n] = d
        return cls(nodes, idx, grad, desc)

    def below(self, b: fx.Node, n: fx.Node) -> bool:
        return bool((self.desc[b] >> self.idx[n]) & 1)


def find_cuts(graph: fx.Graph, sym: sympy.Symbol) -> list[fx.Node]:
    """The valid residual cuts, top (closest to the loss) first, a matmul between any two."""
    f = Flow.of(graph)
    nodes, idx, grad, desc = f.nodes, f.idx, f.grad, f.desc
    compute_users = {n: [u for u in n.users if u.op != "output"] for n in nodes}
    users_bits = {n: sum(1 << idx[u] for u in compute_users[n]) for n in nodes}
    batch_grads = [n for n in nodes if grad[n] and n.op != "output" and batch_dim_of(_val(n), sym) is not None]
    heavy = [n for n in nodes if n.target in _HEAVY]
    cuts = []
    for b in batch_grads:
        if b.op == "placeholder" or not _is_residual(b, desc, idx, heavy):
            continue
        lower = desc[b]
        if any(u is not b and not (lower >> idx[u]) & 1 and users_bits[u] & lower for u in batch_grads):
            continue  # another batch gradient enters below b: b does not carry all of it
        if not any((lower >> idx[h]) & 1 for h in heavy):
            continue  # no matmul below (e.g. the patch embedding's input gradient)
        if cuts and not (desc[cuts[-1]] >> idx[b]) & 1:
            continue
        if cuts and not any((desc[cuts[-1]] >> idx[h]) & 1 and not (lower >> idx[h]) & 1 for h in heavy):
            continue  # no matmul between this cut and the one above: one segment would be empty
        cuts.append(b)
    return cuts


_INDEXED = re.compile(r"^(.*?)(?:\.|\[|, ')(\d+)(?:\]|'\))?$")  # "a.blocks.1", "a.blocks[1]", "getattr(a, '1')"


def _module_stack(n: fx.Node) -> list[tuple[str, str]]:
    """(path, class) of the forward modules a backward node came from, outermost first (AOTAutograd
    copies the forward's ``nn_module_stack`` onto the backward as ``fwd_nn_module_stack``)."""
    st = n.meta.get("fwd_nn_module_stack") or n.meta.get("nn_module_stack") or {}
    return [(str(v[0]), str(v[1])) for v in st.values() if isinstance(v, tuple) and len(v) >= 2]


def find_blocks(graph: fx.Graph) -> dict[fx.Node, str]:
    """Matmul node -> the repeated block it sits in: the outermost module that is an indexed child
    (``layers.3``) with a sibling of the same class (the reference's user-named "repetend", e.g.
    ``BertLayer``, inferred).  Empty when the graph carries no module stack or nothing repeats."""
    owner: dict[fx.Node, tuple[str, str, str]] = {}
    for n in graph.nodes:
        if n.target not in _HEAVY:
            continue
        for path, cls in _module_stack(n):
            m = _INDEXED.match(path)
            if m:
                owner[n] = (path, m.group(1), cls)
                break
    members: dict[tuple[str, str], set] = {}
    for path, parent, cls in owner.values():
        members.setdefault((parent, cls), set()).add(path)
    return {n: o[0] for n, o in owner.items() if len(members[(o[1], o[2])]) >= 2}


def block_cuts(graph: fx.Graph, forks: list[fx.Node], blocks: dict[fx.Node, str]) -> list[fx.Node]:
    """One cut per block, where the reference's ``ActSampler`` sits (on the block's output,
    ``vcas/model_processor.py`` 41-47): the lowest residual fork with all the block's matmuls below
    it.  ``forks`` top first (:func:`find_cuts`); the result too."""
    f = Flow.of(graph)
    by_block: dict[str, list[fx.Node]] = {}
    for n, b in blocks.items():
        by_block.setdefault(b, []).append(n)
    chosen = set()
    for nodes in by_block.values():
        for c in reversed(forks):  # lowest first
            if all(f.below(c, n) for n in nodes):
                chosen.add(c)
                break
    return [c for c in forks if c in chosen]


def _is_residual(b: fx.Node, desc: dict, idx: dict, heavy: list) -> bool:
    """``b`` is the residual stream's gradient: it feeds a skip add whose other summand comes from
    ``b`` through a matmul (a fork), or it is such an add (a join: the lowest block's input gradient
    has no fork when the model's input needs no gradient).  Not the diamonds inside a norm's backward."""

    def through_matmul(src: fx.Node, dst: Any) -> bool:
        return isinstance(dst, fx.Node) and dst is not src and bool((desc[src] >> idx[dst]) & 1) and any(
            (desc[src] >> idx[h]) & 1 and (h is dst or (desc[h] >> idx[dst]) & 1) for h in heavy)

    if b.target in _ADDS and len(b.args) == 2 and all(isinstance(a, fx.Node) for a in b.args):
        x, y = b.args
        if through_matmul(x, y) or through_matmul(y, x):
            return True
    return any(j.target in _ADDS and b in j.args and any(through_matmul(b, o) for o in j.args) for j in b.users)


_aten = torch.ops.aten
_HEAVY = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
_ADDS = (_aten.add.Tensor,)


def split_backward(gm: fx.GraphModule, example_inputs, sym: sympy.Symbol, cuts: list[fx.Node]) -> Segments:
    """Segments of ``gm`` between ``cuts`` (from :func:`find_cuts`); ``gm`` is not modified."""
    graph = gm.graph
    f = Flow.of(graph)
    nodes, grad = f.nodes, f.grad
    seg: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "call_function" and grad[n]:
            seg[n] = sum(1 for b in cuts if f.below(b, n))
    for n in reversed(nodes):
        if n.op == "call_function" and not grad[n]:
            us = [seg[u] for u in n.users if u.op != "output" and u in seg]
            seg[n] = min(us) if us else 0
    for n in nodes:  # multi-output nodes stay with their getitems (no tuple crosses a cut)
        if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node) \
                and n.args[0] in seg and not grad[n]:
            seg[n] = seg[n.args[0]]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    pos = {n: i for i, n in enumerate(placeholders)}
    out_node = next(iter(graph.find_nodes(op="output")))
    outs = out_node.args[0]
    n_seg = len(cuts) + 1
    needed_later: dict[fx.Node, int] = {}  # value -> last segment (or n_seg for final outputs) that reads it
    for n in nodes:
        if n in seg:
            for a in n.all_input_nodes:
                if a in seg and seg[a] < seg[n]:
                    needed_later[a] = max(needed_later.get(a, -1), seg[n])
                elif a in seg and seg[a] > seg[n]:
                    raise Refused(f"segmenting: {n.name} reads {a.name} from a later segment", RefusalKind.VCAS,
                                  node=n)
    for o in outs:
        if isinstance(o, fx.Node) and o in seg:
            needed_later[o] = n_seg
    for b in cuts:
        if b not in needed_later:
            raise Refused(f"segmenting: cut {b.name} is not read below itself", RefusalKind.VCAS, node=b)
    segments = []
    specs: dict[str, Spec] = {}
    for i in range(n_seg):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        inputs, examples = [], []

        def lookup(a: fx.Node) -> fx.Node:
            if a in env:
                return env[a]
            ph = g.placeholder(a.name)
            if a.op == "placeholder":
                inputs.append(("arg", pos[a]))
                ex = example_inputs[pos[a]]
            else:
                inputs.append(("val", a.name))
                ex = _val(a)
                specs.setdefault(a.name, spec_of(ex, sym))
            ph.meta["val"] = ex
            examples.append(ex)
            env[a] = ph
            return ph

        # placeholders first: create them lazily, then move them to the top
        members = [n for n in nodes if seg.get(n) == i]
        for n in members:
            for a in n.all_input_nodes:
                if a not in env and (a.op == "placeholder" or seg.get(a, i) < i):
                    lookup(a)
        for n in members:
            env[n] = g.node_copy(n, lambda a: env[a])
        produced = [n for n in members if n in needed_later]
        g.output(tuple(env[n] for n in produced))
        sgm = fx.GraphModule(gm, g)
        segments.append(Segment(sgm, inputs, [n.name for n in produced],
                                boundary=cuts[i - 1].name if i > 0 else None, examples=examples))
        for n in produced:
            specs.setdefault(n.name, spec_of(_val(n), sym))
    final = []
    for o in outs:
        if isinstance(o, fx.Node) and o.op == "placeholder":
            final.append(("arg", pos[o]))
        elif isinstance(o, fx.Node):
            final.append(("val", o.name))
        else:
            final.append(("const", o))
    return Segments(segments, final, specs, [b.name for b in cuts], sym)

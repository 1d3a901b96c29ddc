"""Each forward of a compiled model is a :class:`ForwardContext`, attached to the autograd node of the
logits it returned (the head graph's compiled function).  The head graph's backward reads it from the
running node, so it always uses *its own* forward's labels and indices, whatever the order of forwards
and backwards (several forwards per backward, retain_graph, metrics forwards never back-propagated, two
models interleaved).  The context lives exactly as long as that node: no registry to evict.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .stats import StepStats

_ATTR = "_capskip_forward"  # the attribute on the logits' autograd node that holds its ForwardContext

NO_HEAD_REASON = ("no graph of this backward ran the rule (a model compiled in place or per block binds its "
                  "logits from its second step on, from the first with compile_regions or "
                  "capskip_fx.mark_compiled_batches; or the logits come from eager code): dense backward")
AFTER_HEAD_REASON = ("the returned logits, or an output computed from them, come from code after the head's "
                     "graph that also passes gradient to something the head's rows do not weight (a learnable "
                     "scale, bias, LayerNorm or Linear on the logits past a graph break or in eager code), or "
                     "code there may move the rows (flip(0), sort(0), softmax over the batch: eager code, or a "
                     "graph past a break that is refused): the rule's weights would not reach it or would land "
                     "on other rows, so no rule runs, dense backward (keep such code in the head's graph, or "
                     "apply a fixed scale as a number)")
OUTSIDE_GRAPH_REASON = ("an output of the forward is a parameter (or an input that requires grad) or a view of one "
                        "(p.expand(N)), which AOTAutograd returns from outside the compiled graph: a loss on it "
                        "would give that parameter every row's gradient, not the rule's; no rule runs, dense "
                        "backward (compute it in the graph, p.expand(N) * 1, or keep the parameter in the model)")
BEFORE_HEAD_REASON = ("an output of the forward holds the batch's rows but comes from a graph before the head's "
                      "(ahead of a graph break) or from eager code: a loss on it would give its rows' gradients to "
                      "the parameters unweighted, the skipped rows' included; no rule runs, dense backward (return "
                      "it from the head's graph: no graph break between it and the head)")
HOOK_REASON = ("a backward hook runs on the returned logits' gradient before the head's graph weights its rows (a "
               "tensor hook on the logits, a full backward hook on the model or a global one): it could move or mix "
               "rows, or see every row's gradient, so no rule runs, dense backward (apply such a change to the loss, "
               "or remove the hook)")
UNBOUND_REASON = ("the returned logits are not the output of a compiled graph, row for row (eager code after a "
                  "graph break, a head left out of a regional compile, or eager ops after the head that move or "
                  "mix rows: flip(0), cumsum(0), sort(0), log_softmax(dim=0), z[1:]): no rule runs, dense backward")


@dataclass(eq=False)
class ForwardContext:
    """One forward of a CapskipModule: its side inputs, and its stats once its head backward ran."""

    targets: Optional[Tensor] = None
    index: Optional[Tensor] = None
    stats: Optional[StepStats] = None
    logits: Any = None  # a weakref to the logits the forward returned, and their version then
    logits_version: int = 0
    dense_reason: Optional[str] = None  # set at the forward: this forward's head runs no rule (outputs_after_head)
    n: int = 0  # the returned logits' rows

    def edited_logits(self, saved: Tensor) -> bool:
        """The returned logits were modified in place since the forward, and ``saved`` (what the backward
        reads) shares their memory: the backward would read the edit, where eager autograd reads none."""
        t = self.logits() if self.logits is not None else None
        if t is None or t._version == self.logits_version:
            return False
        try:
            return t.untyped_storage().data_ptr() == saved.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage (DTensor)
            return False


def bind(fwd: ForwardContext, logits: Any) -> bool:
    """Attach ``fwd`` to the compiled function that produced ``logits``; False if there is none (eager
    logits after the compiled graphs) or it takes no attributes."""
    node = head_node(logits)
    if node is None:
        return False
    try:
        setattr(node, _ATTR, fwd)
    except (AttributeError, TypeError):
        return False
    return True


def current_node() -> Any:
    """The autograd node whose backward is running (None outside a backward)."""
    return torch._C._current_autograd_node()  # a required internal (compat.py checks it at import)


def running_forward() -> Optional[ForwardContext]:
    """The forward bound to the autograd node whose backward is running, if any."""
    current = current_node()
    return getattr(current, _ATTR, None) if current is not None else None


def _compiled(f: Any) -> bool:
    """Whether autograd node ``f`` is a compiled function's (AOTAutograd's ``CompiledFunctionBackward``)."""
    return "CompiledFunction" in type(f).__name__


def _nodes_from(stack: list, descend=lambda f: True, limit: Optional[int] = None):
    """The autograd nodes reachable from those in ``stack`` (themselves included), depth first, each once, at
    most ``limit``; one for which ``descend`` is False is yielded but not walked past.  The running backward
    still holds the graph it walks."""
    seen: set = set()
    while stack and (limit is None or len(seen) < limit):
        f = stack.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        yield f
        if descend(f):
            stack.extend(g for g, _ in f.next_functions)


def _below(node: Any) -> list:
    """The autograd nodes ``node``'s backward passes gradient to (None where an input needs none)."""
    return [f for f, _ in getattr(node, "next_functions", ())]


def upstream_graphs(node: Any) -> set:
    """ids of the compiled functions' autograd nodes upstream of ``node`` (the graphs whose outputs fed the
    graph of ``node``, through eager code or not): a Linear compiled on its own inside the model, the
    blocks of a regional compile."""
    return {id(f) for f in _nodes_from(_below(node)) if _compiled(f)}


def has_upstream_graph(node: Any) -> bool:
    """Whether a compiled function's autograd node lies upstream of ``node`` (stops at the first found)."""
    return any(_compiled(f) for f in _nodes_from(_below(node)))


def bypasses_upstream_graph(node: Any) -> bool:
    """Whether ``node``'s backward passes gradient both to a compiled function upstream (a head graph that
    may select rows) and to something else that function's row weights would not reach: a leaf (a
    parameter: AccumulateGrad), an op with several gradient inputs, a second compiled function.  Views and
    eager ops of a single gradient input are walked through (weighting rows past them weights them too)."""
    found, other = None, False
    for f, _ in getattr(node, "next_functions", ()):
        while f is not None and not _compiled(f):
            nxt = [g for g, _ in f.next_functions if g is not None]
            if len(nxt) != 1:
                other = True
                break
            f = nxt[0]
        else:
            if f is not None:
                other = other or (found is not None and f is not found)
                found = f
    if not other:
        return False
    return found is not None or bool(upstream_graphs(node))  # else no graph upstream selects rows


_WALK_LIMIT = 20_000  # autograd nodes one forward's check may visit (past it: assumed after the head)


def outputs_after_head(out: Any, logits: Tensor) -> bool:
    """Whether another output of the forward is computed from the logits' head graph together with something
    that graph's row weights would not reach: a leaf (a parameter, an input that requires grad) or a value of
    another graph (a LayerNorm, a Linear or a learnable shift of the logits past a graph break or in eager
    code, returned beside them).  A loss on such an output would give those a gradient the rule does not
    weight.  Or through eager code that may move its rows (not row-wise); a graph past a break that moves
    them is found at its backward (heads_upstream).  Walks each other output's autograd graph down to the
    head's node, through any other node."""
    head = head_node(logits)
    if head is None:
        return False
    for o in _other_outputs(out, logits, head):
        reached, other = _walk_to(o.grad_fn, head)
        # reached through eager code that is not row-wise (flip(0) of the head graph's features): the head's
        # row weights would land on other rows than the loss's
        if reached is None or (reached and (other or head_node(o) is None)):
            return True
    return False


def _bound_forward(f: Any) -> Optional[ForwardContext]:
    """The forward bound to autograd node ``f`` if it is a compiled function's, else None."""
    return getattr(f, _ATTR, None) if _compiled(f) else None


def heads_upstream(node: Any) -> list:
    """The forwards bound to compiled functions upstream of ``node``: walks the running backward's autograd
    graph from ``node`` down, not past a bound one (what lies beyond is its body), nor past _WALK_LIMIT nodes."""
    nodes = _nodes_from(_below(node), descend=lambda f: _bound_forward(f) is None, limit=_WALK_LIMIT)
    return [fwd for fwd in map(_bound_forward, nodes) if fwd is not None]


def outputs_before_head(out: Any, logits: Tensor) -> bool:
    """Whether another output of the forward holds the batch's rows (dim 0 of the logits' size) but does not
    come from the head's graph: the output of a graph before a graph break ahead of the head, or of eager
    code.  The row weights act in the head's graph and the graphs it feeds back into; a loss on such an
    output gives its rows' gradients to the parameters unweighted (the rows the head skips included)."""
    head = head_node(logits)
    if head is None or logits.dim() == 0:
        return False
    for o in _other_outputs(out, logits, head):
        if o.dim() > 0 and o.shape[0] == logits.shape[0] and _walk_to(o.grad_fn, head)[0] is False:
            return True
    return False


def _other_outputs(out: Any, logits: Tensor, head: Any) -> list:
    """The forward's outputs besides the logits that take gradient through a node of their own (not the head
    graph's own outputs: its graph is proven as a whole)."""
    return [o for o in torch.utils._pytree.tree_leaves(out)
            if isinstance(o, Tensor) and o is not logits and o.grad_fn is not None and head_node(o) is not head]


def _walk_to(start: Any, head: Any) -> tuple:
    """(whether the autograd graph from ``start`` reaches ``head``, whether it reaches a leaf): walks until it
    knows both; ``(None, None)`` past _WALK_LIMIT nodes."""
    reached = other = False
    for count, f in enumerate(_nodes_from([start], descend=lambda f: f is not head), 1):
        if count > _WALK_LIMIT:
            return None, None
        if f is head:
            reached = True
        elif not f.next_functions:  # a leaf (AccumulateGrad)
            other = True
        if reached and other:
            break
    return reached, other


def outputs_outside_graph(out: Any, logits: Tensor) -> bool:
    """Whether another output of the forward is a leaf that requires grad (a parameter) or a view of one:
    AOTAutograd returns such an output from outside the compiled graph (it regenerates an alias of a graph
    input after the graph), so the graph's row weights, which mask its batch-shaped outputs' tangents, never
    reach it, and a per-row loss on ``p.expand(N)`` would give ``p`` every row's gradient."""
    for o in torch.utils._pytree.tree_leaves(out):
        if not isinstance(o, Tensor) or o is logits or not o.requires_grad:
            continue
        if o.grad_fn is None:  # a leaf itself
            return True
        if _compiled(o.grad_fn):  # a graph's output (maybe a view of a buffer it made)
            continue
        base = o._base if o._is_view() else None
        if base is not None and base.grad_fn is None and base.requires_grad:
            return True
    return False


def logits_of(out: Any, index: Optional[int]) -> Optional[Tensor]:
    """The logits among a model's outputs: the tensor itself, the ``index``-th value of a tuple/list/dict,
    else a dict's ``logits`` (a Hugging Face ModelOutput), else the first 2-D tensor, else the first
    token-shaped (3-D) one (a causal LM's)."""
    if isinstance(out, Tensor):
        return out
    vals = list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, (tuple, list)) else []
    if index is not None and index < len(vals):
        return vals[index]
    if isinstance(out, dict) and isinstance(out.get("logits"), Tensor):
        return out["logits"]
    return next((v for v in vals if isinstance(v, Tensor) and v.dim() == 2),
                next((v for v in vals if isinstance(v, Tensor) and v.dim() == 3), None))


def head_node(t: Any) -> Any:
    """The autograd node of the compiled function whose output ``t`` is, row for row: ``t`` itself, a view of it
    whose row b lies in its row b (AOTAutograd regenerates an output that aliases an intermediate as a view of
    it), or either under eager ops that keep each row's gradient in its row (``_ROWWISE``).  None otherwise:
    eager code that moves or mixes the rows (``flip(0)``, ``cumsum(0)``, ``sort(0)``, ``log_softmax(dim=0)``,
    ``z[1:]``) would have the head weight other rows than the loss's, so no rule may run."""
    if not isinstance(t, Tensor):
        return None
    node = t.grad_fn
    if node is not None and _compiled(node):  # its output (a view made inside it too)
        return node
    if t._is_view():
        if not _rows_inside(t, t._base):
            return None
        node = t._base.grad_fn
    for _ in range(_EAGER_DEPTH):
        if node is None or _compiled(node):
            return node
        nxt = [f for f, _ in node.next_functions if f is not None]
        if len(nxt) != 1 or not _rowwise(node):
            return None
        node = nxt[0]
    return None


_EAGER_DEPTH = 8  # eager row-wise ops walked through between the head's graph and the returned logits


def _rows_inside(v: Tensor, base: Tensor) -> bool:
    """Row b of the view ``v`` lies within row b of its contiguous ``base`` (both split into ``v.shape[0]``
    equal rows of memory): the view keeps each row in its row."""
    if v.dim() == 0 or not base.is_contiguous() or v.shape[0] == 0 or base.numel() % v.shape[0]:
        return False
    if v.shape[0] < base.shape[0] and v.dim() <= base.dim():
        # fewer rows than the base's dim 0 and no dim split off it ((N T, V) viewed (N, T, V)): every other row
        # (t[::2], t.view(N // 2, 2, d)[:, 0]) or a slice: row b of the view is not the base's row b
        return False
    row = base.numel() // v.shape[0]
    rel = v.storage_offset() - base.storage_offset()
    span = sum((size - 1) * stride for size, stride in zip(v.shape[1:], v.stride()[1:]))
    return (v.shape[0] == 1 or v.stride(0) == row) and 0 <= rel and rel + span < row


_COPIES = frozenset({"ToCopyBackward0", "CloneBackward0", "AliasBackward0"})
_SOFTMAX = frozenset({"SoftmaxBackward0", "LogSoftmaxBackward0"})


@functools.lru_cache(maxsize=None)
def _pointwise_node(name: str) -> bool:
    """The node class ``name`` (``MulBackward0``) is the backward of an aten op torch tags pointwise."""
    m = re.fullmatch(r"([A-Za-z0-9]+?)Backward\d*", name)
    if m is None:
        return False
    packet = getattr(torch.ops.aten, re.sub(r"(?<!^)(?=[A-Z])", "_", m.group(1)).lower(), None)
    try:
        overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
        # its functional overloads on a tensor (not .out, nor a SymInt's or a list's): all of them, since one
        # node class may stand for several (MaxBackward0 is max.dim's, a reduction, beside max.other's)
        tensor = [o for o in overloads if not o._schema.is_mutable and o._schema.arguments
                  and isinstance(o._schema.arguments[0].type, torch.TensorType)]
    except (AttributeError, RuntimeError):
        return False
    return bool(tensor) and all(torch.Tag.pointwise in o.tags for o in tensor)


def _rowwise(node: Any) -> bool:
    """An eager op of one gradient input whose backward keeps each row's gradient in its row: a pointwise op
    (its other operands take no gradient, whatever they hold), a cast or copy, a softmax over another dim
    than the batch's.  Views are not walked through here: without their input's sizes, their rows can't be
    checked (head_node checks a view returned as the logits against its base)."""
    name = type(node).__name__
    if name in _COPIES:
        return True
    if name in _SOFTMAX:
        result, dim = getattr(node, "_saved_result", None), getattr(node, "_saved_dim", None)
        return isinstance(result, Tensor) and isinstance(dim, int) and result.dim() > 1 and dim % result.dim() != 0
    return _pointwise_node(name)

"""Each forward of a compiled model is a :class:`ForwardContext`, attached to the autograd node of the
logits it returned (the head graph's compiled function).  The head graph's backward reads it from the
running node, so it always uses *its own* forward's labels and indices, whatever the order of forwards
and backwards (several forwards per backward, retain_graph, metrics forwards never back-propagated, two
models interleaved).  The context lives exactly as long as that node: no registry to evict.
"""
from __future__ import annotations

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
                     "scale, bias, LayerNorm or Linear on the logits past a graph break or in eager code): the "
                     "rule's weights would not reach it, so no rule runs, dense backward (keep such a layer in "
                     "the head's graph, or apply a fixed scale as a number)")
UNBOUND_REASON = ("the returned logits are not the output of a compiled graph (eager code after a graph "
                  "break, or a head left out of a regional compile?): no rule runs, dense backward")


@dataclass(eq=False)
class ForwardContext:
    """One forward of a CapskipModule: its side inputs, and its stats once its head backward ran."""

    targets: Optional[Tensor] = None
    index: Optional[Tensor] = None
    stats: Optional[StepStats] = None
    logits: Any = None  # a weakref to the logits the forward returned, and their version then
    logits_version: int = 0
    dense_reason: Optional[str] = None  # set at the forward: this forward's head runs no rule (outputs_after_head)

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
    node = _compiled_node(getattr(logits, "grad_fn", None))
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


def upstream_graphs(node: Any) -> set:
    """ids of the compiled functions' autograd nodes upstream of ``node`` (the graphs whose outputs fed the
    graph of ``node``, through eager code or not): a Linear compiled on its own inside the model, the
    blocks of a regional compile.  Walks the autograd graph, which the running backward still holds."""
    seen, found, stack = set(), set(), [f for f, _ in getattr(node, "next_functions", ())]
    while stack:
        f = stack.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        if "CompiledFunction" in type(f).__name__:
            found.add(id(f))
        stack.extend(g for g, _ in f.next_functions)
    return found


def bypasses_upstream_graph(node: Any) -> bool:
    """Whether ``node``'s backward passes gradient both to a compiled function upstream (a head graph that
    may select rows) and to something else that function's row weights would not reach: a leaf (a
    parameter: AccumulateGrad), an op with several gradient inputs, a second compiled function.  Views and
    eager ops of a single gradient input are walked through (weighting rows past them weights them too)."""
    found, other = None, False
    for f, _ in getattr(node, "next_functions", ()):
        while f is not None and "CompiledFunction" not in type(f).__name__:
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
    weight.  Walks each other output's autograd graph down to the head's node, through any other node."""
    head = _compiled_node(getattr(logits, "grad_fn", None))
    if head is None:
        return False
    for o in torch.utils._pytree.tree_leaves(out):
        if not isinstance(o, Tensor) or o is logits or o.grad_fn is None:
            continue
        start = o.grad_fn
        if _compiled_node(start) is head:  # the head graph's own output: its graph is proven as a whole
            continue
        seen, stack, reached, other = set(), [start], False, False
        while stack and not (reached and other):
            f = stack.pop()
            if f is None or id(f) in seen:
                continue
            seen.add(id(f))
            if len(seen) > _WALK_LIMIT:
                return True
            if f is head:
                reached = True
                continue
            nxt = list(f.next_functions)
            other = other or not nxt  # a leaf (AccumulateGrad)
            stack.extend(g for g, _ in nxt)
        if reached and other:
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


def _compiled_node(node):
    """The compiled function's autograd node under the views AOTAutograd replays on its outputs."""
    for _ in range(4):
        if node is None or "CompiledFunction" in type(node).__name__:
            break
        nxt = [f for f, _ in node.next_functions if f is not None]
        node = nxt[0] if len(nxt) == 1 else None
    return node

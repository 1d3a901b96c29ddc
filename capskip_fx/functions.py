"""Custom ``torch.autograd.Function``s: row-wise only where the user says so.

The layout proof (placement/) reads the forward only; a Function's own ``backward`` is user code the proof
never sees (``g - g.mean(0)`` mixes rows), so a graph holding one gathers no rows unless its class was
declared row-wise with :func:`rowwise`: its backward's row ``b`` depends only on row ``b`` of its inputs,
outputs and incoming gradients.  Dynamo keeps no reference to the class in the graph, so a declaration is
matched by where the traced backward's code lives (file and line range of ``cls.backward``).
"""
from __future__ import annotations

import re
from typing import Optional

import torch
from torch import fx

_DECLARED: set[tuple[str, int, int]] = set()  # (file, first line, last line) of declared backwards
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def rowwise(cls: type) -> type:
    """Declare a ``torch.autograd.Function`` row-wise (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(f"capskip_fx.rowwise expects a torch.autograd.Function subclass, got {cls!r}")
    code = cls.backward.__code__
    lines = [ln for _, _, ln in code.co_lines() if ln is not None]
    _DECLARED.add((code.co_filename, min(lines + [code.co_firstlineno]), max(lines + [code.co_firstlineno])))
    return cls


def _declared(body: fx.GraphModule) -> bool:
    """Does any op of the traced backward come from a declared backward's lines?"""
    for n in body.graph.nodes:
        for f, ln in _FRAME.findall(n.meta.get("stack_trace") or ""):
            if any(f == df and lo <= int(ln) <= hi for df, lo, hi in _DECLARED):
                return True
    return False


def undeclared_function(gm: fx.GraphModule) -> Optional[str]:
    """Why ``gm`` (a Dynamo graph) can't gather rows: a custom autograd.Function not declared row-wise."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "autograd_function_apply" \
                or "autograd_function_apply" in str(n.target):
            body = getattr(gm, n.args[1].target, None) if isinstance(n.args[1], fx.Node) else None
            if isinstance(body, fx.GraphModule) and _declared(body):
                continue
            where = [ln for ln in (n.meta.get("stack_trace") or "").splitlines()
                     if ln.strip() and ln.strip()[0] not in "^~" and not ln.strip().startswith("File ")]
            return ("a custom torch.autograd.Function whose backward the layout proof can't see"
                    + (f" (at: {where[-1].strip()})" if where else "")
                    + ": declare it with capskip_fx.rowwise(cls) if its backward is row-wise")
    return None

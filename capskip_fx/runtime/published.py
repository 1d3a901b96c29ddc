"""Input gradients a gathered backward returned, each zero outside the rows it ran on.

A gathered backward scatters its input gradients back to N rows: every row outside its index ``idx``
is exactly zero.  When a body graph's incoming gradient (tangent) *is* one of those tensors, unchanged,
the body's nonzero rows lie within ``idx``, so it can run on those rows without reading the device for
them.  Regional compile chains graphs this way (``blocks[i+1](blocks[i](x))``).  Anything that could have
written the skipped rows between the two graphs makes the body find its rows from its own tangent (one
host read), exact whatever that code was.

What "unchanged" is shown by, all of it (``rows_of``):
  - identity: autograd hands over the very tensor (we hold a reference to it, so autograd never
    accumulates a second contribution into it in place; a sum arrives as a new tensor);
  - the version counter: an in-place change (a node hook's ``g.add_``) bumps it;
  - no code that may write through ``.data`` (which bumps nothing) ran on it: every batch output of the
    body graph (``watch``, at its forward) has no tensor hook and no ``retain_grad``, and no module of the
    model (``owner``) has a backward hook, looked up once per backward (no owner known: not shown).  The
    outputs are held from the graph's forward until the end of the backward (a tensor hook outlives the
    Python tensor it was set on, so a freed output would hide it); a graph's next forward replaces them, so
    a forward whose outputs were replaced (two forwards, one backward) finds its rows itself.
Not seen: a hook registered on an autograd node itself (``grad_fn.register_hook``/``register_prehook``)
that writes through ``.data``; docs/limits.md says so.
Invariant: ``rows_of`` returns an index only if every batch-shaped tangent is zero outside it.
The list lives for one backward: an engine callback clears it when the backward ends.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from .clock import graph_task


class PublishedRows:
    def __init__(self) -> None:
        self._items: list[tuple[Tensor, int, Tensor, int]] = []  # (gradient, its version, idx, n)
        self._outputs: dict[int, list[Tensor]] = {}  # compiled forward -> its last batch outputs (watch)
        self._owner: Optional[weakref.ref] = None  # the model, for its module backward hooks
        self.wrapper: Optional[weakref.ref] = None  # capskip_fx.compile's module around the model
        self._hooks: tuple = (None, True)  # (graph task, whether a module backward hook may run) per backward

    def watch(self, graph: int, outs: list) -> None:
        """A compiled forward's (``graph``: its id) batch outputs, for a body graph's later check that nothing
        hooks them.  Called inside the autograd Function's forward (they get their grad_fn after)."""
        self._outputs[graph] = [o for o in outs if isinstance(o, Tensor)]

    def publish(self, outs: list, specs: list, idx: Tensor, n: int) -> None:
        """``outs``: a gathered backward's outputs at N rows; ``specs``: their batch specs (None: not batch)."""
        new = [(o, o._version, idx, n) for o, s in zip(outs, specs)
               if isinstance(o, Tensor) and s is not None and s.kind == "batch"]
        if new:
            self._items.extend(new)
            # once per publishing backward is enough; queued each time so a backward that raised cannot
            # leave the list uncleared for good
            torch.autograd.Variable._execution_engine.queue_callback(self.clear)

    def rows_of(self, tangents: list[Tensor], n: int, node: Any = None) -> Optional[Tensor]:
        """The index every tangent is zero outside, if each one is a published gradient of one index and
        nothing between the graphs can have written it (see the module docstring).  ``node``: the autograd
        node whose backward runs (the body graph's).  A match is dropped from the list (autograd hands a
        gradient to one node): its memory is freed as soon as the body's backward is done with it."""
        idx, hits = None, []
        for t in tangents:
            hit = next((it for it in self._items if it[0] is t), None)
            if hit is None or hit[1] != t._version or hit[3] != n or (idx is not None and hit[2] is not idx):
                return None
            idx = hit[2]
            hits.append(hit)
        if not self._unhooked(node, len(tangents)):
            return None
        self._items = [it for it in self._items if not any(it is h for h in hits)]
        return idx

    def _unhooked(self, node: Any, count: int) -> bool:
        """Every watched output of ``node`` is alive (``count`` of them at least) with no tensor hook, no
        retained grad, and no module backward hook is set."""
        if node is None or self._module_hooks():
            return False
        outs = [o for lst in self._outputs.values() for o in lst if o.grad_fn is node]
        return len(outs) >= count and not any(o._backward_hooks or o.retains_grad for o in outs)

    @property
    def owner(self) -> Optional[weakref.ref]:
        return self._owner

    @owner.setter
    def owner(self, ref: Optional[weakref.ref]) -> None:
        self._owner, self._hooks = ref, (None, True)

    def _module_hooks(self) -> bool:
        """Whether a module backward hook (or the global one) may run in this backward: looked up once per
        backward, when it runs (hooks may be added between the forward and the backward)."""
        task = graph_task()
        if self._hooks[0] != task:
            model = self._owner() if self._owner is not None else None
            self._hooks = (task, model is None or has_backward_hooks(model))
        return self._hooks[1]

    def clear(self) -> None:
        self._items = []
        self._outputs.clear()

    def __len__(self) -> int:
        return len(self._items)


def user_hooks(hooks: dict) -> bool:
    """Whether ``hooks`` (a module's or tensor's hook dict) holds a hook that is not torch.distributed's own
    (FSDP2's pre-backward unshard on the outputs: it reads no gradient)."""
    for hook in hooks.values():
        fn = getattr(hook, "func", hook)  # functools.partial
        fn = getattr(fn, "__func__", fn)  # a bound method
        if not (getattr(fn, "__module__", None) or "").startswith("torch.distributed."):
            return True
    return False


def root_backward_hooks(*roots: Optional[torch.nn.Module]) -> bool:
    """One of ``roots`` (the model, the module wrapping it) or the global registry has a full backward
    (pre-)hook of the user's: it runs on the gradient of the model's outputs."""
    from torch.nn.modules import module as module_mod

    mods = [m for r in roots if r is not None for m in (r, getattr(r, "_orig_mod", None)) if m is not None]
    dicts = [module_mod._global_backward_hooks, module_mod._global_backward_pre_hooks]
    dicts += [d for m in mods for d in (m._backward_hooks, m._backward_pre_hooks)]
    return any(user_hooks(d) for d in dicts)


def has_backward_hooks(model: torch.nn.Module) -> bool:
    """A module (or the global registry) has a full backward (pre-)hook: it may write a gradient's ``.data``."""
    from torch.nn.modules import module as module_mod

    if module_mod._global_backward_hooks or module_mod._global_backward_pre_hooks:
        return True
    return any(m._backward_hooks or m._backward_pre_hooks for m in model.modules())

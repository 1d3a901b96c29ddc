"""capskip's custom ops and the key registry they use to reach run-time objects.

- ``capskip::select(h, z, g, key, loss) -> w``: the head graph's selection (runs the rule); ``loss``: the
  graph inputs an in-graph cross-entropy's dL/dz is derived from (empty otherwise).
- ``capskip::shared(g, key) -> w``: graphs without the head: the rows that carry gradient.
- ``capskip::saved_copy(z) -> z'``: the copy of the logits a head graph returns, ``z`` being saved for
  ``select`` (a clone Inductor's no-op removal would fold back into ``z`` in the joint graph; the
  partitioned forward compiles it as ``aten.clone``, passes/insert_select.fusable_copies).

The ops are opaque to AOTAutograd/Inductor (fake implementations below), so the partitioner saves
``h`` and ``z`` for the backward.  The selected-row backward replaces select/shared by a
graph input; where that rewrite is refused, Inductor calls the eager implementations here and the
backward runs dense-masked (exact, no speed-up).  ``key`` names a run-time object registered with
:func:`register`; this module imports nothing of the runtime (no import cycle).  VCAS's op,
``capskip::sampled_wgrad``, lives with its pass (vcas/sample_wgrad.py).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import Tensor

_OBJECTS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def register(obj: Any) -> int:
    """A key for ``obj`` (held weakly) that graphs can carry as an int argument."""
    key = next(_KEYS)
    _OBJECTS[key] = obj
    return key


def lookup(key: int) -> Any:
    try:
        return _OBJECTS[key]
    except KeyError:
        raise RuntimeError(f"capskip_fx: no run-time object for key {key} (the compiled model was freed)") from None


@torch.library.custom_op("capskip::select", mutates_args=())
def select(h: Tensor, z: Tensor, g: Tensor, key: int, loss: list[Tensor]) -> Tensor:
    """``loss`` (a keyword in the graph, ``[]`` when none): an in-graph cross-entropy's inputs
    (passes/loss_grad.py), read so that the partitioner hands them to the backward; the backward pass takes
    them off the node (the eager op ignores them)."""
    return lookup(key).select_op(h, z, g).clone()


@select.register_fake
def _select_fake(h: Tensor, z: Tensor, g: Tensor, key: int, loss: list[Tensor]) -> Tensor:
    return g.new_empty(g.shape[0])


@torch.library.custom_op("capskip::shared", mutates_args=())
def shared(g: Tensor, key: int) -> Tensor:
    """Eager (refused) body graphs: all rows (the dense-masked backward of a body is the dense one)."""
    return g.new_ones(g.shape[0])


@shared.register_fake
def _shared_fake(g: Tensor, key: int) -> Tensor:
    return g.new_empty(g.shape[0])


@torch.library.custom_op("capskip::saved_copy", mutates_args=())
def saved_copy(z: Tensor) -> Tensor:
    return torch.empty_like(z).copy_(z)  # the fake's strides, whatever z's layout


@saved_copy.register_fake
def _saved_copy_fake(z: Tensor) -> Tensor:
    return torch.empty_like(z)

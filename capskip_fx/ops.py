"""The selection node: ``capskip::select(h, z, g, key) -> w``.

Inserted by the joint-graph pass; opaque to AOTAutograd/Inductor (a custom op with a fake
implementation), so the partitioner saves ``h`` and ``z`` for the backward because the node
uses them.  The selected-row backward pass replaces it by a graph input; where that rewrite
is refused, Inductor calls this eager implementation and the backward runs dense-masked
(exact, no speed-up).  ``key`` names the :class:`RuntimeState` of the compiled model.
"""
from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor

from .runtime.state import RuntimeState

_STATES: "weakref.WeakValueDictionary[int, RuntimeState]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def register_state(state: RuntimeState) -> int:
    key = next(_KEYS)
    _STATES[key] = state
    return key


def state_for(key: int) -> RuntimeState:
    try:
        return _STATES[key]
    except KeyError:
        raise RuntimeError(f"capskip_fx: no runtime state for key {key} (compiled model was freed)") from None


@torch.library.custom_op("capskip::select", mutates_args=())
def select(h: Tensor, z: Tensor, g: Tensor, key: int) -> Tensor:
    weight, _ = state_for(key).select(h, z, g)
    return weight.clone()


@select.register_fake
def _select_fake(h: Tensor, z: Tensor, g: Tensor, key: int) -> Tensor:
    return g.new_empty(g.shape[0])


@torch.library.custom_op("capskip::shared", mutates_args=())
def shared(g: Tensor, key: int) -> Tensor:
    """Body graphs (no head: below a graph break, DDP bucket splits): the head graph's kept rows.

    Rows the head graph skipped already carry a zero gradient here, so the 0/1 mask changes
    nothing numerically; it marks which rows the backward may drop.
    """
    mask = state_for(key).shared_mask(g.shape[0])
    return (mask if mask is not None else g.new_ones(g.shape[0])).to(g.dtype).clone()


@shared.register_fake
def _shared_fake(g: Tensor, key: int) -> Tensor:
    return g.new_empty(g.shape[0])


@torch.library.custom_op("capskip::sampled_wgrad", mutates_args=())
def sampled_wgrad(g: Tensor, x: Tensor, key: int, slot: int) -> Tensor:
    """VCAS SampleW: ``g.T @ x`` over Bernoulli-sampled rows reweighted by 1/p (see passes/sample_wgrad.py).

    ``key`` names the :class:`~capskip_fx.runtime.vcas.VcasBackward` running this backward; it holds
    the ratio ``nu`` of matmul ``slot`` and whether this pass samples, probes or runs exact.
    """
    from .runtime.vcas import runner_for

    return runner_for(key).wgrad(g, x, slot)


@sampled_wgrad.register_fake
def _sampled_wgrad_fake(g: Tensor, x: Tensor, key: int, slot: int) -> Tensor:
    return g.new_empty(g.shape[1], x.shape[1])

"""Input gradients a gathered backward returned, each zero outside the rows it ran on.

A gathered backward scatters its input gradients back to N rows: every row outside its index ``idx``
is exactly zero.  When a body graph's incoming gradient (tangent) *is* one of those tensors, the same
object at the same version, nothing between the two graphs added to it or changed it: the body's
nonzero rows lie within ``idx``, so it can run on those rows without reading the device for them.
Regional compile chains graphs this way (``blocks[i+1](blocks[i](x))``).  Anything else between the
graphs (an eager op, a second consumer, a hook) makes autograd hand over another tensor: the body then
finds its rows from its own tangent (one host read), exact whatever that code was.

Why identity is a proof: we hold a reference to each published tensor, so autograd never accumulates
a second contribution into it in place (it does so only for a buffer nobody else holds); a sum arrives
as a new tensor.  An in-place change by a hook bumps the version counter.
Invariant: ``rows_of`` returns an index only if every batch-shaped tangent is zero outside it.
The list lives for one backward: an engine callback clears it when the backward ends.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


class PublishedRows:
    def __init__(self) -> None:
        self._items: list[tuple[Tensor, int, Tensor, int]] = []  # (gradient, its version, idx, n)

    def publish(self, outs: list, specs: list, idx: Tensor, n: int) -> None:
        """``outs``: a gathered backward's outputs at N rows; ``specs``: their batch specs (None: not batch)."""
        new = [(o, o._version, idx, n) for o, s in zip(outs, specs)
               if isinstance(o, Tensor) and s is not None and s.kind == "batch"]
        if new:
            self._items.extend(new)
            # once per publishing backward is enough; queued each time so a backward that raised cannot
            # leave the list uncleared for good
            torch.autograd.Variable._execution_engine.queue_callback(self.clear)

    def rows_of(self, tangents: list[Tensor], n: int) -> Optional[Tensor]:
        """The index every tangent is zero outside, if each one is a published gradient of one index.
        A match is dropped from the list (autograd hands a gradient to one node): its memory is freed
        as soon as the body's backward is done with it, not at the end of the whole backward."""
        idx, hits = None, []
        for t in tangents:
            hit = next((it for it in self._items if it[0] is t), None)
            if hit is None or hit[1] != t._version or hit[3] != n or (idx is not None and hit[2] is not idx):
                return None
            idx = hit[2]
            hits.append(hit)
        self._items = [it for it in self._items if not any(it is h for h in hits)]
        return idx

    def clear(self) -> None:
        self._items = []

    def __len__(self) -> int:
        return len(self._items)

"""The global view of a selection (``scope="global"``): under torch.distributed, the head's h, z, dL/dz,
labels and indices all-gathered once per step, so every rank runs the rule over the global batch and
makes the same decision; each rank then keeps its own rows of the weight.  ``scope="per_rank"`` (or no
process group, or one rank) is the local view: nothing is communicated.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..rules.labels import infer_targets


class GlobalView(NamedTuple):
    """What the rule runs on; ``lo``: this rank's first row in the gathered batch (None: only this rank's rows)."""

    h: Tensor
    z: Tensor
    g: Optional[Tensor]  # None: the rule reads no dL/dz and it was not computed yet (an in-graph loss)
    targets: Optional[Tensor]
    index: Optional[Tensor]
    lo: Optional[int] = None

    def local_rows(self, weight: Tensor, n: int) -> Tensor:
        """This rank's ``n`` rows of a weight decided over the view's rows."""
        return weight if self.lo is None else weight[self.lo:self.lo + n]


def global_view(scope: str, h: Tensor, z: Tensor, g: Optional[Tensor], targets: Optional[Tensor],
              index: Optional[Tensor]) -> GlobalView:
    """The tensors the rule runs on: this rank's, or (``scope="global"``) every rank's, in rank order."""
    import torch.distributed as dist

    if scope != "global" or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return GlobalView(h, z, g, targets, index)
    world, rank, n = dist.get_world_size(), dist.get_rank(), z.shape[0]
    sizes = [torch.zeros(1, dtype=torch.long, device=z.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([n], device=z.device))
    if any(int(s) != n for s in sizes):
        raise ValueError(f"scope='global' needs the same batch size on every rank, got {[int(s) for s in sizes]}")

    def cat(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    # ranks without explicit labels contribute the ones dL/dz implies, so every rank sees one label set;
    # without dL/dz (a rule that reads neither it nor labels) the labels are gathered only where given
    y = targets if targets is not None or g is None else infer_targets(g)
    y = cat(y.to(z.device).long()) if y is not None else None
    idx = cat(index.to(z.device)) if index is not None else None
    return GlobalView(cat(h), cat(z), cat(g) if g is not None else None, y, idx, rank * n)

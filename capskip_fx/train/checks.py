"""The exact distortion check (selected vs dense gradient of one batch) and the compile-aware clock."""
from __future__ import annotations

import collections
import math
import statistics
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class CompileClock:
    """Training wall-clock with compile steps' excess over steady steps taken out."""

    def __init__(self, window: int = 200):
        self.total = 0.0  # loop time: data wait + step time
        self.compile_steps: list[float] = []
        self.steady = collections.deque(maxlen=window)

    def add(self, data_s: float, step_s: float, is_compile: bool) -> None:
        self.total += data_s + step_s
        (self.compile_steps.append if is_compile else self.steady.append)(step_s)

    @property
    def compile_s(self) -> float:
        med = statistics.median(self.steady) if self.steady else 0.0
        return sum(max(0.0, t - med) for t in self.compile_steps)

    @property
    def wall_s(self) -> float:
        return self.total - self.compile_s

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "compile_steps": list(self.compile_steps), "steady": list(self.steady)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = float(state["total"])
        self.compile_steps = list(state["compile_steps"])
        self.steady.clear()
        self.steady.extend(state["steady"])


def _norms(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    """Cosine and relative L2 ||a - b|| / ||b|| over a list of tensors, in float64."""
    dot = sum((x.double() * y.double()).sum() for x, y in zip(a, b))
    na = math.sqrt(sum(x.double().square().sum() for x in a))
    nb = math.sqrt(sum(y.double().square().sum() for y in b))
    nd = math.sqrt(sum((x.double() - y.double()).square().sum() for x, y in zip(a, b)))
    return {"cos": float(dot) / (na * nb) if na > 0 and nb > 0 else math.nan,
            "rel_l2": nd / nb if nb > 0 else math.nan, "norm_selected": na, "norm_dense": nb}


def distortion_check(model: nn.Module, head: nn.Module, x, y, autocast, rng_state,
                     weights=None, loss_of=F.cross_entropy) -> dict[str, float]:
    """Dense backward of the full loss on the same batch through the eager model; compare with the
    selected gradients currently in ``.grad``, then put those back.  ``weights``: per-sample loss
    weights (InfoBatch's), the loss then being ``mean(weights * per-sample loss)`` as in training."""
    params = [p for p in model.parameters() if p.requires_grad]
    head_ids = {id(p) for p in head.parameters()}
    selected = [p.grad for p in params]
    for p in params:
        p.grad = None
    cpu_state, cuda_state = rng_state  # same dropout masks as the selected forward (eager)
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state, x.device)
    with autocast():
        z = model(x)
        loss = loss_of(z, y) if weights is None else (loss_of(z.float(), y, reduction="none") * weights).mean()
    loss.backward()
    dense = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    sel = [g if g is not None else torch.zeros_like(p) for g, p in zip(selected, params)]
    for p, g in zip(params, selected):
        p.grad = g
    allm = _norms(sel, dense)
    hm = _norms([g for g, p in zip(sel, params) if id(p) in head_ids],
                [g for g, p in zip(dense, params) if id(p) in head_ids])
    return {"cos_all": allm["cos"], "rel_l2_all": allm["rel_l2"], "cos_head": hm["cos"],
            "rel_l2_head": hm["rel_l2"], "dense_loss": loss.item()}

"""Per-model runtime state: the rule, the step's side inputs (targets, dataset indices) and stats.

The compiled backward calls :meth:`RuntimeState.select` once per step with what the head saw.
Stats are kept as tensors where reading them would sync the device; ``StepStats.bound`` syncs
lazily, only when read.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..rules.base import HeadView, Rule, Selection


@dataclass
class StepStats:
    step: int = 0
    n: int = 0
    kept: int = 0
    rows: int = 0  # rows the backward actually ran on (kept + zero-weight padding)
    fallback: Optional[str] = None
    variants: int = 0
    selection_ms: float = 0.0
    weight: Optional[Tensor] = None
    _bound: Optional[Tensor] = field(default=None, repr=False)

    @property
    def bound(self) -> float:
        """||S_k|| / ||G|| for capskip (reads the device once); NaN for rules without a bound."""
        return float(self._bound) if self._bound is not None else math.nan

    @property
    def kept_fraction(self) -> float:
        return self.kept / self.n if self.n else math.nan

    def as_dict(self) -> dict:
        return {"step": self.step, "n": self.n, "kept": self.kept, "rows": self.rows,
                "bound": self.bound, "fallback": self.fallback, "variants": self.variants,
                "selection_ms": self.selection_ms}


class RuntimeState:
    """Everything one compiled model needs at run time; looked up by ``key`` from the graph."""

    def __init__(self, rule: Rule, seed: int = 0):
        self.rule = rule
        self.step = 0
        self.epoch = 0
        self.seed = seed
        self._generator: Optional[torch.Generator] = None
        self.targets: Optional[Tensor] = None
        self.index: Optional[Tensor] = None
        self.last = StepStats()
        self.variants = 0  # compiled selected-row backward variants
        self.fallback: Optional[str] = None  # sticky reason for the current graph, if it runs dense
        self._warned: set[str] = set()
        self.head_bias = True  # set by the graph pass from the head it found

    # -- side inputs -----------------------------------------------------------------
    def set_step_inputs(self, targets: Optional[Tensor], index: Optional[Tensor]) -> None:
        self.targets = targets
        self.index = index

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"capskip_fx: {reason}", stacklevel=3)

    # -- the selection ---------------------------------------------------------------
    def select(self, h: Tensor, z: Tensor, g: Tensor) -> tuple[Tensor, int]:
        """Run the rule on one step.  Returns ``(weight (N,), k)``; reads k from the device once."""
        t0 = time.perf_counter()
        n = g.shape[0]
        targets = self.targets
        if targets is not None and targets.shape[0] != n:
            raise ValueError(f"capskip_targets has {targets.shape[0]} rows but the batch has {n}")
        finite = torch.isfinite(g).all() & torch.isfinite(z).all() & torch.isfinite(h).all()
        view = HeadView(delta=g.detach(), h=h.detach(), z=z.detach(), targets=targets,
                        index=self.index, step=self.step, epoch=self.epoch,
                        generator=self.generator(g.device), head_bias=self.head_bias)
        sel: Selection = self.rule.select(view) if n > 0 else Selection(weight=g.new_ones(0))
        weight = sel.weight.to(g.dtype)
        # one host read for both: the kept count and whether the step was finite
        k, ok = torch.stack([(weight != 0).sum(), finite.long()]).tolist()
        fallback = None
        if not ok:
            fallback = "non-finite logits or gradient: selection skipped, dense backward"
            self.warn_once(fallback)
            weight, k = torch.ones_like(weight), n
            sel.bound = None
        self.last = StepStats(step=self.step, n=n, kept=int(k), rows=n, fallback=fallback or self.fallback,
                              variants=self.variants, weight=weight.detach(), _bound=sel.bound,
                              selection_ms=(time.perf_counter() - t0) * 1e3)
        self.step += 1
        return weight, int(k)

    # -- sharing the head's decision with body graphs (graph breaks, DDP splits) -------------
    def publish(self, weight: Tensor, k: int) -> None:
        self._published = ((weight != 0).to(weight.dtype), k, self.step)

    def shared_mask(self, n: int) -> Optional[Tensor]:
        pub = getattr(self, "_published", None)
        return pub[0] if pub is not None and pub[0].shape[0] == n else None

    def consume(self, record, n: int, like: Tensor) -> tuple[Tensor, int]:
        """A body graph's rows: this step's published mask, once per graph; else all rows."""
        pub = getattr(self, "_published", None)
        if pub is None or pub[0].shape[0] != n or record.consumed_step == pub[2]:
            reason = record.no_head or "no head selection published for this step"
            if pub is None:
                self.fallback = self.fallback or reason
                self.warn_once(f"{reason} -> dense backward")
                self.last = StepStats(step=self.step, n=n, kept=n, rows=n, fallback=self.fallback,
                                      variants=self.variants)
            return like.new_ones(n), n
        record.consumed_step = pub[2]
        return pub[0].to(like.dtype), pub[1]

    def record_dense_step(self, n: int) -> None:
        """Stats for a step whose graph was refused: every row ran, and why."""
        self.last = StepStats(step=self.step, n=n, kept=n, rows=n, fallback=self.fallback, variants=self.variants)
        self.step += 1

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rule": self.rule.state_dict(), "step": self.step, "epoch": self.epoch,
                "generator": None if self._generator is None else self._generator.get_state(),
                "generator_device": None if self._generator is None else str(self._generator.device)}

    def load_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state.get("rule", {}))
        self.step = state.get("step", 0)
        self.epoch = state.get("epoch", 0)
        if state.get("generator") is not None:
            self._generator = torch.Generator(device=state.get("generator_device") or "cpu")
            self._generator.set_state(state["generator"])

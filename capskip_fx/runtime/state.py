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
from ..rules.labels import SOFTMAX_RESIDUAL_TOL, bad_targets, infer_targets, softmax_residual

_LABEL_FREE_RULES = ("dense", "forced")


def _f32(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _needs_labels(rule: Rule) -> bool:
    """Does the rule read labels (correctness, per-example CE)?  ``rule.needs_labels`` overrides."""
    flag = getattr(rule, "needs_labels", None)
    if flag is not None:
        return bool(flag)
    if rule.name == "random":  # a random twin reads labels only through the rule it matches
        return getattr(rule, "match", None) is not None and _needs_labels(rule.match)
    return rule.name not in _LABEL_FREE_RULES


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
    vcas: Optional[dict] = None  # with VCAS: probe?, rows per segment, s, rho, nu, (kept, total) per sampled matmul
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

    def __init__(self, rule: Rule, seed: int = 0, scope: str = "per_rank"):
        self.rule = rule
        self.scope = scope
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
        self._published: Optional[tuple[Tensor, int, int]] = None  # head's (0/1 mask, k, step) for body graphs
        self._logits_node = None  # autograd node of the logits the model returned last
        self.vcas_runners: list = []  # VCAS backwards, one per compiled backward graph (runtime/vcas.py)
        self.vcas_pending: list = []  # their controller states from a checkpoint loaded before they compiled

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
        """Run the rule on one step.  Returns ``(weight (N,), k)``; two host reads (checks, then k)."""
        t0 = time.perf_counter()
        n = g.shape[0]
        targets = self.targets
        if targets is not None and targets.shape[0] != n:
            raise ValueError(f"capskip_targets has {targets.shape[0]} rows but the batch has {n}")
        h, z, g, index, lo = self._global_view(h.detach(), z.detach(), g.detach(), targets)
        if lo is not None:
            targets = self._gathered_targets
        finite = torch.isfinite(g).all() & torch.isfinite(z).all() & torch.isfinite(h).all()
        # checked before the rule runs: stateful rules (SB's history, KABENA's controller) must never
        # see a NaN step, and labels the rule can't use must not reach it silently
        fallback = self._precheck(finite, g, targets)
        if fallback is None:
            # selection math in float32 whatever the autocast dtype (bf16 Grams/losses are too coarse)
            view = HeadView(delta=_f32(g), h=_f32(h), z=_f32(z), targets=targets, index=index, step=self.step,
                            epoch=self.epoch, generator=self.generator(g.device), head_bias=self.head_bias)
            sel: Selection = self.rule.select(view) if g.shape[0] > 0 else Selection(weight=g.new_ones(0))
            weight = sel.weight.to(g.dtype)
            if lo is not None:  # every rank decided over the global batch; keep this rank's rows
                weight = weight[lo:lo + n]
            k = int((weight != 0).sum())  # the second host read
        else:
            self.warn_once(fallback)
            sel = Selection(weight=g.new_ones(n))
            weight, k = sel.weight, n
        self.last = StepStats(step=self.step, n=n, kept=int(k), rows=n, fallback=fallback or self.fallback,
                              variants=self.variants, weight=weight.detach(), _bound=sel.bound,
                              selection_ms=(time.perf_counter() - t0) * 1e3)
        self.step += 1
        return weight, int(k)

    def _precheck(self, finite: Tensor, g: Tensor, targets: Optional[Tensor]) -> Optional[str]:
        """One host read before the rule: why to skip it (dense step), or None.  Bad labels raise."""
        checks = {"finite": finite}
        if targets is not None:
            checks["bad_targets"] = bad_targets(targets.to(g.device), g.shape[1])
        if g.shape[0] > 0 and _needs_labels(self.rule):
            # an unused 2-D output picked as the logits reads as "every row free": CAPSkip would skip all
            checks["zero"] = (g == 0).all()
            if targets is None:
                checks["not_softmax"] = softmax_residual(g) > SOFTMAX_RESIDUAL_TOL
        flags = dict(zip(checks, torch.stack(list(checks.values())).tolist()))
        if flags.get("bad_targets"):
            t = targets.to(g.device)
            raise ValueError(f"capskip_targets must be class labels in [-1, {g.shape[1]}) for logits with "
                             f"{g.shape[1]} classes (-1 = unknown); got values in "
                             f"[{int(t.min())}, {int(t.max())}]")
        if not flags["finite"]:
            return "non-finite logits or gradient: selection skipped, dense backward"
        if flags.get("zero"):
            return ("dL/dz of the logits output is zero on every row: the loss does not use that output "
                    "(another (N, C) Linear output first in a tuple/dict?); pass logits_index= to "
                    "capskip_fx.compile. Selection skipped, dense backward")
        if flags.get("not_softmax"):
            return ("dL/dz is not the gradient of a softmax loss (its rows don't sum to 0, e.g. MSE on the "
                    "logits): labels can't be inferred from it; pass model(x, capskip_targets=y). "
                    "Selection skipped, dense backward")
        return None

    def _global_view(self, h, z, g, targets):
        """scope="global": all-gather the head's tensors (and labels, indices) across ranks."""
        import torch.distributed as dist

        if self.scope != "global" or not (dist.is_available() and dist.is_initialized()) \
                or dist.get_world_size() == 1:
            return h, z, g, self.index, None
        world, rank, n = dist.get_world_size(), dist.get_rank(), g.shape[0]
        sizes = [torch.zeros(1, dtype=torch.long, device=g.device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([n], device=g.device))
        if any(int(s) != n for s in sizes):
            raise ValueError(f"scope='global' needs the same batch size on every rank, got {[int(s) for s in sizes]}")

        def cat(t):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            return torch.cat(parts)

        # ranks without explicit labels contribute the ones dL/dz implies, so every rank sees one label set
        y = self.targets if self.targets is not None else infer_targets(g)
        self._gathered_targets = cat(y.to(g.device).long())
        idx = cat(self.index.to(g.device)) if self.index is not None else None
        return cat(h), cat(z), cat(g), idx, rank * n

    # -- sharing the head's decision with body graphs (graph breaks, DDP splits) -------------
    def publish(self, weight: Tensor, k: int) -> None:
        self._published = ((weight != 0).to(weight.dtype), k, self.step)

    def shared_mask(self, n: int) -> Optional[Tensor]:
        pub = self._published
        return pub[0] if pub is not None and pub[0].shape[0] == n else None

    def set_logits(self, out) -> None:
        """Remember the autograd node of the logits the model returned (the head's backward)."""
        node = getattr(out, "grad_fn", None)
        for _ in range(4):  # views that AOTAutograd replays on top of the compiled function's node
            if node is None or "CompiledFunction" in type(node).__name__:
                break
            nxt = [f for f, _ in node.next_functions if f is not None]
            node = nxt[0] if len(nxt) == 1 else None
        self._logits_node = node

    def is_logits_backward(self) -> bool:
        """Is the running backward the one of the returned logits?  (True when unknown.)"""
        node = self._logits_node
        current = getattr(torch._C, "_current_autograd_node", lambda: None)()
        return node is None or current is None or current is node

    def consume(self, record, n: int, like: Tensor) -> tuple[Tensor, int]:
        """A body graph's rows: this step's published mask, once per graph; else all rows."""
        pub = self._published
        if pub is None or pub[0].shape[0] != n or record.consumed_step == pub[2]:
            reason = record.no_head or "no head selection published for this step"
            record.refuse(reason)
            record.backward = "dense-masked"
            if pub is None:
                self.fallback = self.fallback or reason
                self.warn_once(f"{reason} -> dense backward")
                self.last = StepStats(step=self.step, n=n, kept=n, rows=n, fallback=self.fallback,
                                      variants=self.variants)
            return like.new_ones(n), n
        record.consumed_step = pub[2]
        return pub[0].to(like.dtype), pub[1]

    def record_dense_step(self, n: int, reason: Optional[str] = None) -> None:
        """Stats for a step whose graph was refused (or that ran eagerly): every row ran, and why."""
        self.last = StepStats(step=self.step, n=n, kept=n, rows=n, fallback=reason or self.fallback,
                              variants=self.variants)
        self.step += 1

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rule": self.rule.state_dict(), "step": self.step, "epoch": self.epoch,
                "generator": None if self._generator is None else self._generator.get_state(),
                "generator_device": None if self._generator is None else str(self._generator.device),
                "vcas": [r.ctrl.state_dict() for r in self.vcas_runners] or list(self.vcas_pending)}

    def load_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state.get("rule", {}))
        self.step = state.get("step", 0)
        self.epoch = state.get("epoch", 0)
        self.vcas_pending = list(state.get("vcas", []))
        for r, st in zip(self.vcas_runners, self.vcas_pending):
            r.ctrl.load_state_dict(st)
        if state.get("generator") is not None:
            self._generator = torch.Generator(device=state.get("generator_device") or "cpu")
            self._generator.set_state(state["generator"])

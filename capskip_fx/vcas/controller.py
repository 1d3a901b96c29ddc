"""VCAS (Xiao et al., ICLR 2024; spec: shared/research/algorithms.md §4): variance-controlled sampling
inside the backward.  Not an example-selection rule: it runs on whatever rows the rule kept.

This file holds the options and the controller; sampling.py the sampling math; the graph side is
segment_backward.py (SampleA: the backward cut at residual-stream forks), sample_wgrad.py (SampleW:
the weight-gradient matmuls) and runtime.py (runs the segments, samples between them, probes).

- SampleA / SampleW keep row ``i`` with probability ``p_i = soft_topk`` and scale it by ``1/p_i``
  (unbiased; with independent draws the added variance is ``sum (1/p - 1) ||y_i||^2``).
- The controller (every ``freq`` steps, on the current batch): exact backward of two random halves
  (their difference estimates the SGD variance, their sum is the step's gradient), ``probes``
  activation-sampled backwards (Monte-Carlo activation variance), the closed-form weight variance;
  then ``s``, ``rho_l``, ``nu_l`` as in VCAS (``vcas/sample_scheme.py``, ``update``):
    * ``s += s_step`` if act-variance / SGD-variance > ``tau_act`` else ``-= s_step``, in [0, 1];
    * the new schedule ``find_top_sum(norms_l, s)`` is made monotone the reference's way: walking
      up from the bottom boundary, each boundary is RAISED to the running max of those below it
      (layers closer to the loss keep at least as many rows); then EMA ``rho <- d rho + (1-d) new``;
    * ``nu_l /= w_mul`` if its weight-variance ratio > ``tau_w`` else ``*= w_mul``, with no cap at 1
      (``nu_max=inf``, the reference: a ``nu`` above 1 runs exact and has to decay below 1 before
      sampling resumes, a hysteresis) and no floor (``nu_min=0``, the reference).
- Budgets are integers as in the reference (``k = int(N * rho)``, ``k_w = int(T * nu)``: see
  :func:`vcas_k`); ``k = 0`` means no sampling there (the reference's ``ActSampler`` passes the
  gradient through when no row survives, ``leverage_k`` runs the exact matmul for ``k == 0``), while
  the probe's closed-form weight variance at ``k = 0`` is huge (the reference's ``soft_topk`` gives
  every row probability ~1e-9), so ``nu`` climbs back.
- FLOPs (:meth:`VcasController.flops_fraction`): the reference's per-step units
  ``(1 + mean rho + mean(nu rho)) / 3`` plus the probes' cost amortised over ``freq`` steps.

Kept deliberately (quirk fixes and constraints of running inside one backward):
  * the Monte-Carlo passes use distinct seeds (the reference reseeds each with the same value, so its
    M passes are one draw);
  * the new ``rho`` schedule is computed at the new ``s`` (the reference pairs an increase of ``s``
    with the schedule for ``s - 0.01`` and vice versa);
  * the probe uses the current batch: the SGD variance comes from the difference of two random halves
    of it (the reference: M extra batches from a cycling loader), and the probe step's returned
    gradient is the exact one (the sum of the halves);
  * SampleW's variance is the reference's ``cal_leverage_var`` where it measures it (its
    ``linear.py`` 42-59, ``vcas_trainer.py`` 58-62): during the activation-sampled passes, on the
    rows they carry, kept rows scaled by ``1/p`` (so it grows as ``rho`` falls), the mean over the
    passes; with every ``rho`` at 1 on the whole batch's exact rows.  Its SGD variance is per matmul
    from the two halves (the reference: over M batches);
  * rho and nu count the rows that carry gradient (after the example-level rule), not all N;
  * the first probe is at step 0 (the reference's at step F; both start from rho = nu = 1);
  * ``sampler="systematic"`` (the default) draws exactly the budget ``k`` rows with the reference's
    inclusion probabilities (sampling.systematic_keep), where the reference draws independent
    Bernoullis (``sampler="bernoulli"``) whose random count a gathered backward must read on the host
    once per resampling cut and per sampled matmul.  The fixed size is what keeps VCAS within one host
    read per step (none of its own on a sampled step); the estimate stays unbiased.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from torch import Tensor


def find_top_sum(norms: Tensor, share: float) -> float:
    """Smallest fraction of rows whose largest norms sum to at least ``share`` of the total."""
    n = norms.numel()
    if n == 0:
        return 1.0
    srt, _ = torch.sort(norms.detach().double().flatten(), descending=True)
    total = float(srt.sum())
    if total <= 0:
        return 1.0 / n
    # a rounding tolerance, but never as large as a row: at share 1 no positive row may be left out
    tol = min(1e-12 * total, 0.5 * float(srt[srt > 0].min()))
    need = share * total - tol
    m = int(torch.searchsorted(srt.cumsum(0), torch.tensor([need], dtype=torch.float64)).item()) + 1
    return min(n, max(1, m)) / n


@dataclass(frozen=True)
class VCAS:
    """VCAS options (defaults of thu-ml/VCAS).

    tau_act, tau_w: added-variance budgets relative to the SGD variance.  freq: a probe every F
    backward steps (the first at step 0).  probes: M activation-sampled Monte-Carlo passes per probe.
    s_step, w_mul, rho_decay: controller steps.  sample_act / sample_w switch SampleA / SampleW.
    nu_min, nu_max: floor and cap of the weight ratios; the reference has neither (0, inf: the
    defaults); ``nu_max=1`` is our earlier cap (no hysteresis).  cut: ``"block"`` (the
    reference's samplers: one cut on each repeated block's output, blocks inferred from the module
    stack; every residual fork when no repeated block is found) or ``"fork"`` (finer: every
    residual fork, i.e. attention and MLP sub-blocks of a pre-norm transformer, and an input
    projection's output).  every: keep every k-th of those cuts.
    sampler: ``"systematic"`` (exactly the budget's rows, no host read) or ``"bernoulli"`` (the
    reference's independent draws; one host read per resampling cut and per sampled matmul).
    """

    tau_act: float = 0.025
    tau_w: float = 0.025
    freq: int = 100
    probes: int = 2
    s_step: float = 0.01
    w_mul: float = 0.95
    rho_decay: float = 0.6
    sample_act: bool = True
    sample_w: bool = True
    nu_min: float = 0.0
    nu_max: float = math.inf
    every: int = 1
    sampler: str = "systematic"
    cut: str = "block"

    def __post_init__(self):
        for name in ("tau_act", "tau_w"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"VCAS {name} must be a positive number, got {v!r}")
        for name in ("freq", "probes", "every"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"VCAS {name} must be a positive int, got {v!r}")
        if not (isinstance(self.s_step, (int, float)) and 0 < self.s_step <= 1):
            raise ValueError(f"VCAS s_step must be in (0, 1], got {self.s_step!r}")
        if not 0 < self.w_mul < 1:
            raise ValueError(f"VCAS w_mul must be in (0, 1), got {self.w_mul!r}")
        for name in ("rho_decay", "nu_min"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"VCAS {name} must be in [0, 1], got {getattr(self, name)!r}")
        for name, choices in (("cut", ("block", "fork")), ("sampler", ("systematic", "bernoulli"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"VCAS {name} must be {' or '.join(map(repr, choices))}, got {getattr(self, name)!r}")
        if not (isinstance(self.nu_max, (int, float)) and self.nu_max >= 1):  # also rejects NaN
            raise ValueError(f"VCAS nu_max must be >= 1 (inf: no cap, the reference), got {self.nu_max!r}")


@dataclass
class ProbeResult:
    """What one probe measured (sums over the sampled part of the network)."""

    sgd_var: float
    act_var: float
    w_var: list  # closed form per sampled weight-gradient matmul
    w_sgd_var: list  # SGD variance of the same matmul's output
    norms: list  # per boundary: exact per-row gradient norms (Tensor)


@dataclass
class VcasController:
    """``s``, ``rho`` (per boundary, top first) and ``nu`` (per sampled matmul); VCAS's update."""

    cfg: VCAS
    s: float = 1.0
    rho: list = field(default_factory=list)
    nu: list = field(default_factory=list)
    step: int = 0
    probes_done: int = 0
    last: dict = field(default_factory=dict)
    flops_mean: float = 1.0  # running mean over probes of flops_fraction(), taken before each update

    def ensure(self, boundaries: int, matmuls: int) -> None:
        if len(self.rho) != boundaries:
            self.rho = [1.0] * boundaries
        if len(self.nu) != matmuls:
            self.nu = [1.0] * matmuls

    def is_probe(self) -> bool:
        return self.step % self.cfg.freq == 0

    def update(self, r: ProbeResult) -> None:
        cfg = self.cfg
        act_ratio = r.act_var / r.sgd_var if r.sgd_var > 0 else (0.0 if r.act_var == 0 else math.inf)
        if act_ratio > cfg.tau_act:
            self.s = min(1.0, self.s + cfg.s_step)
        else:
            self.s = max(0.0, self.s - cfg.s_step)
        # the reference logs the FLOPs ratio of the schedule in force before this update
        self.flops_mean = (self.flops_mean * self.probes_done + self.flops_fraction()) / (self.probes_done + 1)
        new = [find_top_sum(nm, self.s) for nm in r.norms]  # at the new s (the reference's quirk fixed)
        # rho is top first; the reference (bottom first) raises each boundary to the running max of the
        # ones below it, so layers closer to the loss keep at least as many rows
        for i in range(len(new) - 2, -1, -1):
            new[i] = max(new[i], new[i + 1])
        self.rho = [cfg.rho_decay * old + (1 - cfg.rho_decay) * nw for old, nw in zip(self.rho, new)]
        w_ratio = []
        for j, (wv, sv) in enumerate(zip(r.w_var, r.w_sgd_var)):
            ratio = wv / sv if sv > 0 else (0.0 if wv == 0 else math.inf)
            w_ratio.append(ratio)
            nu = self.nu[j] / cfg.w_mul if ratio > cfg.tau_w else self.nu[j] * cfg.w_mul
            self.nu[j] = min(cfg.nu_max, max(cfg.nu_min, nu))
        self.probes_done += 1
        self.last = {"act_ratio": act_ratio, "w_ratio": w_ratio, "sgd_var": r.sgd_var, "act_var": r.act_var}

    def step_units(self, slot_boundary: Optional[list] = None, clip_nu: bool = True) -> float:
        """A sampled step in VCAS's units (3 = dense: forward, activation backward, weight backward):
        ``1 + mean(rho) + mean_s(nu_s * rho_b(s))``.  ``slot_boundary[s]``: the boundary whose rho
        matmul ``s`` runs under (the reference: its block); without it ``mean(nu) * mean(rho)`` (the
        same when every block has as many matmuls).  ``clip_nu``: a ``nu >= 1`` matmul runs exact, so
        it counts 1 (the reference's log counts the raw ``nu``)."""
        rho = self.rho or [1.0]
        mean_rho = sum(rho) / len(rho)
        nu = [min(1.0, v) if clip_nu else v for v in (self.nu or [1.0])]
        if slot_boundary is not None and self.nu and self.rho:
            w = sum(v * rho[b] for v, b in zip(nu, slot_boundary)) / len(nu)
        else:
            w = (sum(nu) / len(nu)) * mean_rho
        return 1 + mean_rho + w

    def flops_fraction(self, accounting: str = "ours", slot_boundary: Optional[list] = None) -> float:
        """Training FLOPs relative to dense, probes included, amortised over ``freq`` steps.

        ``"reference"``: thu-ml/VCAS's log, ``(units * F + 3 M + M^2 (1 + 2 mean rho)) / (3 F)``
        (M = probes: M extra exact forward+backward passes and M^2 activation-sampled ones, all
        counted on top of F sampled steps; raw nu).  ``"ours"``: what our probe runs: every F-th step
        is the probe instead of a sampled step (exact forward + two exact half backwards = 3 units)
        plus M activation-sampled backwards on the same forward (2 mean rho units each; only while
        some rho < 1): ``((F - 1) units + 3 + M 2 mean rho [rho < 1]) / (3 F)``."""
        cfg = self.cfg
        rho = self.rho or [1.0]
        mean_rho = sum(rho) / len(rho)
        F, M = cfg.freq, cfg.probes
        if accounting == "reference":
            units = self.step_units(slot_boundary, clip_nu=False)
            return (units * F + 3 * M + M * M * (1 + 2 * mean_rho)) / (3 * F)
        if accounting != "ours":
            raise ValueError(f"accounting must be 'ours' or 'reference', got {accounting!r}")
        units = self.step_units(slot_boundary)
        act_probes = M * 2 * mean_rho if (cfg.sample_act and any(r < 1.0 for r in rho)) else 0.0
        return ((F - 1) * units + 3 + act_probes) / (3 * F)

    def state_dict(self) -> dict:
        return {"s": self.s, "rho": list(self.rho), "nu": list(self.nu), "step": self.step,
                "probes_done": self.probes_done, "flops_mean": self.flops_mean, "config": asdict(self.cfg)}

    def load_state_dict(self, state: dict) -> None:
        self.s = float(state.get("s", 1.0))
        self.rho = list(state.get("rho", [1.0] * len(self.rho)))  # missing: a fresh controller's
        self.nu = list(state.get("nu", [1.0] * len(self.nu)))
        self.step = int(state.get("step", 0))
        self.probes_done = int(state.get("probes_done", 0))
        self.flops_mean = float(state.get("flops_mean", 1.0))

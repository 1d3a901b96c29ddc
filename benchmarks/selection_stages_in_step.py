"""Where CAPSkip's eager selection spends its time inside the training step (issue 32, the 1.10x check of
``selection_cost.py --mlp``): cumulative stages of ``select`` against the ``forced`` rule, and what one eager
op costs there.

The --mlp check's model (3-layer MLP, N = 1024, d = 512, C = 10, compiled with capskip_fx.compile, CAPSkip
b = 0.3).  Every arm's rule returns the rows the first CAPSkip step kept (so every backward is the same
gathered one) after running a prefix of CAPSkip's own computation: nothing; the correct rows; the sort key
and the sort; the two gathers; the prefix norms (the route the cost model picks); then CAPSkip itself (the
rest: the scan, weights, bound).  Arms interleaved step by step in one process, the order rotated each round;
per arm the median over steps of (its step - the forced step of the same round), warm-up rounds excluded.
The probe: inside the step, one eager ``add`` on 1024 floats, then 29 more of the same.
-> benchmarks/results/<stem>.{md,json}

    python benchmarks/selection_stages_in_step.py --threads 2
"""
from __future__ import annotations

import math
import pathlib
import statistics
import sys
import time

import torch

import capskip_fx
from capskip_fx.rules import CAPSkip, Forced
from capskip_fx.rules.base import Selection, prefix_sq_norms, scalar_one
from capskip_fx.rules.labels import correct_mask
from results_io import write_results
from selection_cost import MLP_SHAPE, mlp_in_step_cli, timed

STAGES = ("runtime only", "+ correct rows", "+ sort key, sort", "+ gathers", "+ prefix norms")


class Stage(CAPSkip):
    """Runs CAPSkip's first ``upto`` stages (2-D logits, bias), then returns a fixed selection."""

    def __init__(self, upto: int, weight: torch.Tensor, budget: float):
        super().__init__(budget=budget)
        self.upto, self.weight = upto, weight
        self.probe: list = []

    def select(self, view):
        d, x = view.delta, view.h
        if self.upto >= 1:
            correct = correct_mask(d, view.z, view.targets)
        if self.upto >= 2:
            nx = torch.linalg.vector_norm(x, dim=1)
            key = torch.where(correct, torch.linalg.vecdot(d, d) * torch.addcmul(scalar_one(nx), nx, nx), math.inf)
            order = torch.sort(key, stable=True).indices
        if self.upto >= 3:
            ds, xs = d.index_select(0, order), x.index_select(0, order)
        if self.upto >= 4:
            prefix_sq_norms(ds, xs, None, None, True)
        if self.upto < 0:  # the probe
            a = view.z[:, 0].contiguous()
            t0 = time.perf_counter()
            a = a + 1
            t1 = time.perf_counter()
            for _ in range(29):
                a = a + 1
            self.probe.append((t1 - t0, (time.perf_counter() - t1) / 29))
        return Selection(weight=self.weight.clone())


def main() -> None:
    a, cm, step = mlp_in_step_cli(__doc__, 80)
    for _ in range(3):
        step()
    weight = capskip_fx.stats(cm).weight.clone()
    kept = weight != 0
    arms = {"forced": Forced(keep=lambda _: kept)}
    arms.update({name: Stage(i, weight, a.budget) for i, name in enumerate(STAGES)})
    arms["CAPSkip (all of select)"] = CAPSkip(budget=a.budget)
    probe = arms["probe"] = Stage(-1, weight, a.budget)
    names = list(arms)
    times: dict = {k: [] for k in names}
    for r in range(a.warmup + a.steps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            cm.rule = arms[k]
            dt = timed(step)
            if k != "forced" and not torch.equal(capskip_fx.stats(cm).weight != 0, kept):
                raise RuntimeError(f"{k} kept other rows than the first CAPSkip step")
            if r >= a.warmup:
                times[k].append(dt)
    forced = times["forced"]
    extra = {k: statistics.median(t - f for t, f in zip(v, forced)) * 1e3 for k, v in times.items() if k != "forced"}
    first = statistics.median(t for t, _ in probe.probe[a.warmup:]) * 1e6
    rest = statistics.median(t for _, t in probe.probe[a.warmup:]) * 1e6
    cmd = "python benchmarks/" + pathlib.Path(sys.argv[0]).name + " " + " ".join(sys.argv[1:])
    n, d, c = MLP_SHAPE
    fm = statistics.median(forced) * 1e3
    md = [f"<!-- {cmd} -->", "# CAPSkip's eager selection by stage, inside the step", "",
          f"3-layer MLP, N = {n}, d = {d}, C = {c}, CAPSkip b = {a.budget}, {a.threads} thread(s), {a.steps} rounds "
          f"(after {a.warmup}); forced step {fm:.2f} ms (median).", "",
          "| arm (cumulative) | step - forced step, ms (median) |", "|---|---|"]
    md += [f"| {k} | {v:.3f} |" for k, v in extra.items() if k != "probe"]
    md += ["", f"One eager `add` on 1024 floats inside the step: the first {first:.1f} µs, each of the next 29 "
           f"{rest:.1f} µs (medians)."]
    print("\n".join(md))
    stem = pathlib.Path(a.out) if a.out else \
        pathlib.Path(__file__).parent / "results" / f"selection_stages_t{a.threads}"
    write_results(stem, {"args": vars(a), "forced_ms": fm, "extra_ms": extra, "probe_first_us": first,
                         "probe_next_us": rest, "times_s": times}, "\n".join(md))


if __name__ == "__main__":
    main()

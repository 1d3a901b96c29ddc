"""CAPSkip's eager selection inside the training step against the same call replayed: why the eager route
costs more in the step than its warm timing says (issue 32, the 1.10x check of ``selection_cost.py --mlp``).

The --mlp check's model (3-layer MLP, N = 1024, d = 512, C = 10, compiled with capskip_fx.compile, CAPSkip
b = 0.3, the running-sum route).  In each step the rule's ``select`` runs twice on the same head view: the
first call is the step's own (its inputs and code cold after the compiled kernels), the second replays it at
once.  After the steps, the last view's call is replayed back to back outside any step (warm).  Medians,
warm-up steps excluded.  -> benchmarks/results/<stem>.{md,json}

    python benchmarks/selection_in_step.py --threads 2
"""
from __future__ import annotations

import pathlib
import statistics
import sys
import time

from capskip_fx.rules import CAPSkip
from results_io import write_results
from selection_cost import MLP_SHAPE, mlp_in_step_cli


class TwiceTimed(CAPSkip):
    """CAPSkip whose ``select`` runs twice per step, timing each call; the first call's selection is used."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls, self.view = [], None

    def select(self, view):
        t0 = time.perf_counter()
        sel = super().select(view)
        t1 = time.perf_counter()
        super().select(view)
        self.calls.append((t1 - t0, time.perf_counter() - t1))
        self.view = view
        return sel


def main() -> None:
    a, cm, step = mlp_in_step_cli(__doc__, 60)
    rule = cm.rule = TwiceTimed(budget=a.budget)
    for _ in range(a.warmup + a.steps):
        step()
    calls = rule.calls[a.warmup:]
    plain = CAPSkip(budget=a.budget)
    for _ in range(a.warmup):
        plain.select(rule.view)
    warm = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        plain.select(rule.view)
        warm.append(time.perf_counter() - t0)
    ms = {"in the step": statistics.median(c[0] for c in calls) * 1e3,
          "replayed at once, in the step": statistics.median(c[1] for c in calls) * 1e3,
          "replayed back to back, outside the step": statistics.median(warm) * 1e3}
    cmd = "python benchmarks/" + pathlib.Path(sys.argv[0]).name + " " + " ".join(sys.argv[1:])
    n, d, c = MLP_SHAPE
    md = [f"<!-- {cmd} -->", "# CAPSkip's eager selection in the step and replayed", "",
          f"3-layer MLP, N = {n}, d = {d}, C = {c}, CAPSkip b = {a.budget}, {a.threads} thread(s), {a.steps} steps "
          f"(after {a.warmup}).", "", "| call | select ms (median) |", "|---|---|"]
    md += [f"| {k} | {v:.2f} |" for k, v in ms.items()]
    print("\n".join(md))
    stem = pathlib.Path(a.out) if a.out else pathlib.Path(__file__).parent / "results" / f"selection_in_step_t{a.threads}"
    write_results(stem, {"args": vars(a), "median_ms": ms, "calls_s": calls, "warm_s": warm},
                  "\n".join(md))


if __name__ == "__main__":
    main()

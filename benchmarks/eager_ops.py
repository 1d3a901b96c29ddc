"""Eager aten ops per training step, per rule: the runtime's glue around the compiled graphs.

Counted by capskip_fx.debug.count_eager_ops (torch.profiler): the aten ops a step dispatches outside
Inductor's compiled graphs, each once where it is called (not the ops it calls itself), over the forward,
the loss (cross-entropy outside the model) and the backward; ``in graphs`` counts what the compiled graphs
dispatch themselves (matmuls as extern kernels, and anything Inductor could not fuse).  Inductor, because
aot_eager interprets its graphs op by op (all of them would count as eager).  A tiny MLP (12 -> 16 GELU
-> 5), N = 16, float32; steps 0-3 warm up (compile, verify), then the median over ``--steps`` steps;
``--timed``: the median time of that many more steps, unprofiled (forward, loss, backward).
-> benchmarks/results/<stem>.{md,json}

    python benchmarks/eager_ops.py [--threads 1] [--steps 3] [--timed 200] [--ops] [--out STEM]
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.debug import eager_ops_per_step
from results_io import write_results

CASES = [  # (label, capskip_fx.compile options; None: plain torch.compile)
    ("torch.compile", None),
    ("dense", dict(rule="dense")),
    ("forced keep=0.5", dict(rule="forced", keep=0.5)),
    ("capskip b=0.5", dict(rule="capskip", budget=0.5)),
    ("sb keep=0.5", dict(rule="sb", keep=0.5, start=0, end=1, interrupt=0)),
    ("random keep=0.5", dict(rule="random", keep=0.5)),
]
N, D, HIDDEN, C = 16, 12, 16, 5
WARMUP = 4


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, C))


def measure(opts, steps: int = 3, warmup: int = WARMUP, backend: str = "inductor", timed: int = 0):
    """(eager ops per measured step, in-graph ops per measured step, the last step's op counts, its stats,
    the median step time in microseconds over ``timed`` more steps, unprofiled, or None)."""
    torch.manual_seed(0)
    model = make_model()
    cm = torch.compile(model, backend=backend) if opts is None else capskip_fx.compile(model, backend=backend, **opts)
    g = torch.Generator().manual_seed(0)
    batches = ((torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g)) for _ in range(warmup + steps))
    measured = eager_ops_per_step(cm, model, batches, warmup, capskip_fx.stats if opts is not None else None)
    eager = [len(ops) for ops, _ in measured]
    in_graphs = [sum(ops.in_graphs.values()) for ops, _ in measured]
    last, st = measured[-1]
    times = []
    for _ in range(timed):
        x, y = torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g)
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        F.cross_entropy(cm(x), y).backward()
        times.append((time.perf_counter() - t0) * 1e6)
    return eager, in_graphs, last, st, statistics.median(times) if times else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ops", action="store_true", help="print each case's eager ops by name")
    ap.add_argument("--timed", type=int, default=0, help="also time this many unprofiled steps (median us)")
    ap.add_argument("--out", default=None, help="results stem (default benchmarks/results/cpu_eager_ops)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    for label, opts in CASES:
        eager, in_graphs, ops, st, us = measure(opts, a.steps, timed=a.timed)
        rows.append({"case": label, "eager_ops": statistics.median(eager), "in_graphs": statistics.median(in_graphs),
                     "steps": eager, "mode": st.mode if st else "", "kept": st.kept if st else N,
                     "rows": st.rows if st else N, "step_us": us, "ops": dict(ops.eager)})
        print({k: v for k, v in rows[-1].items() if k != "ops"}, flush=True)
        if a.ops:
            for name, c in ops.eager.most_common():
                print(f"    {c:3d} {name}")
    cmd = "python benchmarks/eager_ops.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = [f"# Eager aten ops per training step (cpu, Inductor, torch {torch.__version__}, {a.threads} thread(s), "
          f"MLP {D}-{HIDDEN}-{C}, N={N}, median of {a.steps} steps after {WARMUP})", "", f"`{cmd.strip()}`", "",
          "| case | eager aten ops | in compiled graphs | mode (kept / rows of N) | step us (median) |",
          "|---|---|---|---|---|"]
    us = lambda r: "" if r["step_us"] is None else f"{r['step_us']:.0f}"
    md += [f"| {r['case']} | {r['eager_ops']:g} | {r['in_graphs']:g} | {r['mode'] or 'plain'} "
           f"({r['kept']} / {r['rows']} of {N}) | {us(r)} |" for r in rows]
    stem = pathlib.Path(a.out) if a.out else pathlib.Path(__file__).parent / "results" / "cpu_eager_ops"
    write_results(stem, rows, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""Selection cost as a share of the dense step: CAPSkip (the route its cost model picks, and both exact
routes), K-ABENA and SB, over N x C x d; one process, interleaved round-robin per point, medians, warm-up
excluded.

    python benchmarks/selection_cost.py --threads 1                       # the table (docs/benchmarks.md)
    python benchmarks/selection_cost.py --threads 2 --mlp                 # CAPSkip's step vs forced's, same rows
    python benchmarks/selection_cost.py --mlp --device cuda               # the same on a GPU (examples/gpu_check.sh)
    python benchmarks/selection_cost.py --threads 2 --blocks --n 256 1024 4096 --d 192 512 768   # block sizes

Table: per point, the rows' dL/dz are cross-entropy's on random logits (N, C) whose labels are the argmax
for --correct-frac of the rows; h (N, d) standard normal.  "dense" = an eager forward + backward of a
3-layer MLP d -> d -> d -> C at batch N with mean CE (the step the selection is added to).  Each rule's
time is its whole ``select`` (labels, losses, the draw); CAPSkip's also ``capskip_weights`` by route.

--mlp: the issue's check.  A 3-layer MLP (in 512, hidden 512, C = 10), N = 1024, compiled with
capskip_fx.compile; steps of CAPSkip (b = 0.3; eager selection, and ``compile=True``: the running sums
compiled with static shapes) alternate with steps of the ``forced`` rule keeping exactly the rows CAPSkip
kept on the same batch (same model, same graphs, the rule swapped).

--blocks: the running-sum route's block size.  Per point, ``prefix_sq_norms`` (bias column, random d and x)
at every power-of-two block from 32 to min(N, 512), and the Gram, interleaved: the block prefix_route
picks against the fastest.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import torch.nn as nn
import torch.nn.functional as F

from capskip_fx.cpu import retain_freed_memory
from capskip_fx.rules import CAPSkip, HeadView, KABENA, SelectiveBackprop
from capskip_fx.rules.base import prefix_route, prefix_sq_norms
from capskip_fx.rules.capskip import capskip_weights
from capskip_fx.rules.labels import correct_mask


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n", type=int, nargs="+", default=[64, 256, 1024, 4096])
    p.add_argument("--c", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--d", type=int, nargs="+", default=[192, 768])
    p.add_argument("--budget", type=float, default=0.3)
    p.add_argument("--correct-frac", type=float, default=0.7)
    p.add_argument("--reps", type=int, default=7, help="timed rounds per point (at least 3 when a point is slow)")
    p.add_argument("--point-seconds", type=float, default=20.0, help="stop adding rounds to a point after this")
    p.add_argument("--mlp", action="store_true", help="the compiled MLP step check instead of the table")
    p.add_argument("--compiled", action="store_true",
                   help="table: one more column, CAPSkip(compile=True)'s select (its compile before the timing)")
    p.add_argument("--blocks", action="store_true", help="the running route's block sizes instead of the table")
    p.add_argument("--steps", type=int, default=30, help="--mlp: timed steps per arm")
    p.add_argument("--device", default="cpu", help="--mlp: where the model and batch live (cpu or cuda)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--no-malloc-tuning", action="store_true",
                   help="keep glibc's malloc defaults (by default capskip_fx.cpu.retain_freed_memory(), as the "
                        "training CLI, step_time.py and interleaved.py set it)")
    return p.parse_args(argv)


def timed(fn, device: str = "cpu") -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def interleave(arms: dict, reps: int, budget_s: float) -> dict[str, float]:
    """Median seconds per arm: one untimed round, then rounds of every arm in turn, the order rotated each
    round (the arm after the dense step would otherwise always start with cold caches)."""
    for fn in arms.values():
        fn()
    times = {k: [] for k in arms}
    names = list(arms)
    t_end = time.perf_counter() + budget_s
    for r in range(reps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(timed(arms[k]))
        if r >= 2 and time.perf_counter() > t_end:
            break
    return {k: statistics.median(v) for k, v in times.items()}


def point(n: int, c: int, d: int, a) -> dict:
    g = torch.Generator().manual_seed(n * 7919 + c * 31 + d)
    z = torch.randn(n, c, generator=g) * 3
    y = torch.randint(0, c, (n,), generator=g)
    right = torch.rand(n, generator=g) < a.correct_frac
    y = torch.where(right, z.argmax(1), y)
    delta = (z.softmax(1) - F.one_hot(y, c).float()) / n
    h = torch.randn(n, d, generator=g)
    correct = correct_mask(delta, z, y)
    view = HeadView(delta=delta, h=h, z=z, targets=y, generator=torch.Generator().manual_seed(0))
    mlp = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.GELU(), nn.Linear(d, c))
    x = torch.randn(n, d, generator=g)
    capskip, kabena, sb = CAPSkip(budget=a.budget, compile=False), KABENA(), SelectiveBackprop(prime_epochs=0)

    def dense():
        mlp.zero_grad(set_to_none=True)
        F.cross_entropy(mlp(x), y).backward()

    arms = {"dense": dense,
            "capskip": lambda: capskip.select(view),
            "gram": lambda: capskip_weights(delta, h, correct, a.budget, route="gram"),
            "running": lambda: capskip_weights(delta, h, correct, a.budget, route="running"),
            "kabena": lambda: kabena.select(view),
            "sb": lambda: sb.select(view)}
    if a.compiled:
        compiled = CAPSkip(budget=a.budget, compile=True)
        compiled.select(view)  # the compile (static shapes for the running sums)
        arms["compiled"] = lambda: compiled.select(view)
    med = interleave(arms, a.reps, a.point_seconds)
    w = {r: capskip_weights(delta, h, correct, a.budget, route=r)[0] for r in ("gram", "running")}
    return {"n": n, "c": c, "d": d, "route": prefix_route(n, c, d + 1)[0],
            "same_selection": bool(torch.equal(w["gram"], w["running"])), "kept": int((w["gram"] != 0).sum()),
            "ms": {k: v * 1e3 for k, v in med.items()},
            "share": {k: v / med["dense"] for k, v in med.items() if k != "dense"}}


def blocks(a) -> list[dict]:
    rows = []
    print("| N | C | d | route, block picked | its ms | fastest | its ms | picked / fastest | Gram ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in a.n:
        for c in a.c:
            for d in a.d:
                g = torch.Generator().manual_seed(n * 7919 + c * 31 + d)
                dd, x = torch.randn(n, c, generator=g), torch.randn(n, d, generator=g)
                arms = {f"running {b}": (lambda b=b: prefix_sq_norms(dd, x, "running", b, bias=True))
                        for b in (32, 64, 128, 256, 512) if b <= n}
                arms["gram"] = lambda: prefix_sq_norms(dd, x, "gram", bias=True)
                ms = {k: v * 1e3 for k, v in interleave(arms, a.reps, a.point_seconds).items()}
                route, block = prefix_route(n, c, d + 1)
                picked = "gram" if route == "gram" else f"running {block}"
                fastest = min(ms, key=ms.get)
                rows.append({"n": n, "c": c, "d": d, "picked": picked, "fastest": fastest, "ms": ms})
                print(f"| {n} | {c} | {d} | {picked} | {ms[picked]:.2f} | {fastest} | {ms[fastest]:.2f} | "
                      f"{ms[picked] / ms[fastest]:.2f} | {ms['gram']:.2f} |", flush=True)
    return rows


def table(a) -> list[dict]:
    rows = []
    extra = " CAPSkip compile=True |" if a.compiled else ""
    print("| N | C | d | route | dense ms | CAPSkip (auto) | gram | running | K-ABENA | SB | same kept set |" + extra)
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if a.compiled else ""))
    for n in a.n:
        for c in a.c:
            for d in a.d:
                r = point(n, c, d, a)
                rows.append(r)
                s = r["share"]
                print(f"| {n} | {c} | {d} | {r['route']} | {r['ms']['dense']:.2f} | {s['capskip']:.1%} | "
                      f"{s['gram']:.1%} | {s['running']:.1%} | {s['kabena']:.1%} | {s['sb']:.1%} | "
                      f"{'yes' if r['same_selection'] else 'no'} |"
                      + (f" {s['compiled']:.1%} |" if a.compiled else ""), flush=True)
    return rows


MLP_SHAPE = (1024, 512, 10)  # --mlp: N, d, C


def mlp_setup(budget: float, correct_frac: float, device: str = "cpu"):
    """--mlp's model compiled with CAPSkip, and one training step on its fixed batch: ``(cm, step)``."""
    import capskip_fx

    n, d, c = MLP_SHAPE
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.GELU(), nn.Linear(d, c)).to(device)
    cm = capskip_fx.compile(model, rule="capskip", budget=budget)
    x = torch.randn(n, d).to(device)
    with torch.no_grad():
        pred = model(x).argmax(1)
    right = (torch.rand(n, generator=torch.Generator().manual_seed(1)) < correct_frac).to(device)
    y = torch.where(right, pred, torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(2)).to(device))

    def step():
        cm.zero_grad(set_to_none=True)
        F.cross_entropy(cm(x), y).backward()

    return cm, step


def mlp_in_step_cli(doc: str, steps: int):
    """The in-step scripts' shared command line and setup (selection_in_step.py, selection_stages_in_step.py):
    ``(args, cm, step)`` with the threads set, freed memory kept and --mlp's model compiled."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--budget", type=float, default=0.3)
    p.add_argument("--correct-frac", type=float, default=0.7)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    retain_freed_memory()
    return (a, *mlp_setup(a.budget, a.correct_frac))


def mlp_check(a) -> dict:
    import capskip_fx
    from capskip_fx.rules import Forced

    n, d, c = MLP_SHAPE
    cm, step = mlp_setup(a.budget, a.correct_frac, a.device)
    capskip, compiled = CAPSkip(budget=a.budget), CAPSkip(budget=a.budget, compile=True)

    t0 = time.perf_counter()
    step()
    step()  # compiles (and the selected backward's variant)
    warm = time.perf_counter() - t0
    st = capskip_fx.stats(cm)
    kept = st.weight != 0
    forced = Forced(keep=lambda _: kept)
    out = {"capskip": [], "capskip_compiled": [], "forced": [], "selection_ms": []}
    modes = {}
    for i in range(a.steps + 2):
        for name, rule in (("capskip", capskip), ("capskip_compiled", compiled), ("forced", forced)):
            cm.rule = rule
            dt = timed(step, a.device)
            s = capskip_fx.stats(cm)
            modes[name] = (s.mode, s.kept, s.rows)
            if name != "forced" and not torch.equal(s.weight != 0, kept):
                raise RuntimeError(f"{name} kept other rows than the first CAPSkip step")
            if i >= 2:  # warm-up rounds excluded
                out[name].append(dt)
                if name == "capskip":
                    out["selection_ms"].append(s.selection_ms)
    ratio = [a_ / b_ for a_, b_ in zip(out["capskip"], out["forced"])]
    ratio_c = [a_ / b_ for a_, b_ in zip(out["capskip_compiled"], out["forced"])]
    res = {"n": n, "d": d, "c": c, "device": a.device, "budget": a.budget, "kept": int(kept.sum()), "modes": modes,
           "warmup_s": warm,
           "capskip_ms": statistics.median(out["capskip"]) * 1e3, "forced_ms": statistics.median(out["forced"]) * 1e3,
           "ratio_median": statistics.median(ratio), "selection_ms": statistics.median(out["selection_ms"]),
           "capskip_compiled_ms": statistics.median(out["capskip_compiled"]) * 1e3,
           "ratio_median_compiled": statistics.median(ratio_c),
           "route": prefix_route(n, c, d + 1)[0]}
    print(json.dumps(res, indent=1))
    return res


def main(argv=None):
    a = parse(argv)
    torch.set_num_threads(a.threads)
    malloc_tuned = not a.no_malloc_tuning and retain_freed_memory()
    head = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "threads": a.threads,
            "malloc_tuned": malloc_tuned,
            "torch": torch.__version__, "load": os.getloadavg(), "argv": sys.argv[1:]}
    print(f"# {head}", flush=True)
    res = mlp_check(a) if a.mlp else blocks(a) if a.blocks else table(a)
    head["load_after"] = os.getloadavg()
    print(f"# load average after: {head['load_after']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**head, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()

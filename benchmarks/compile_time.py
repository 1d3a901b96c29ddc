"""Compile time of the first training step: plain torch.compile (Inductor) against capskip_fx.compile.

Each measurement is a fresh process (`--child`) on a depth-2 deit_tiny (img 32, patch 4, N=32) that
times its first and second step (forward + backward; the first compiles).  Per variant:
  cold     empty Inductor cache directory
  restart  a new process, same cache directory (what a restarted job pays)
  warm     in the restarted process, a second model instance compiled after the first
           (torch._dynamo.reset() between: Dynamo retraces, the caches are warm)
Variants: plain torch.compile (static batch, what Dynamo picks for a first call), plain with the batch dim
marked dynamic (torch._dynamo.mark_dynamic: what capskip_fx.compile traces, as its backward needs a
symbolic batch), capskip_fx.compile, and capskip_fx.compile with gather="graph" (each selected backward
compiled a second time, gathering its own rows).  Median of --repeats runs; results to
benchmarks/results/compile_time.{md,json}.

    python benchmarks/compile_time.py --repeats 3
    python benchmarks/compile_time.py --repeats 3 --variants capskip capskip_gather_graph --out ...
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from results_io import write_results

HERE = pathlib.Path(__file__).resolve().parent
VARIANTS = ("plain", "plain_dynamic", "capskip", "capskip_gather_graph")


def child(variant: str) -> dict:
    import timm
    import torch
    import torch.nn.functional as F

    import capskip_fx
    from torch._dynamo.utils import counters

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))

    def build():
        torch.manual_seed(0)
        m = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4,
                              num_classes=10, depth=2)
        if variant.startswith("plain"):
            return m, torch.compile(m)
        gather = "graph" if variant == "capskip_gather_graph" else "eager"
        return m, capskip_fx.compile(m, rule="forced", keep=0.5, gather=gather)

    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    if variant == "plain_dynamic":
        torch._dynamo.mark_dynamic(x, 0)

    def step(cm, m):
        m.zero_grad(set_to_none=True)
        t = time.perf_counter()
        F.cross_entropy(cm(x), y).backward()
        return time.perf_counter() - t

    out = {}
    m, cm = build()
    out["first_s"], out["second_s"] = step(cm, m), step(cm, m)
    torch._dynamo.reset()
    m2, cm2 = build()
    out["warm_first_s"] = step(cm2, m2)
    out["fxgraph_hit"] = counters["inductor"]["fxgraph_cache_hit"]
    out["fxgraph_miss"] = counters["inductor"]["fxgraph_cache_miss"]
    out["aotautograd_hit"] = counters["aot_autograd"]["autograd_cache_hit"]
    return out


def run(variant: str, cache: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    r = subprocess.run([sys.executable, __file__, "--child", variant], env=env, capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "compile_time"))
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS[:3])
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child)))
        return
    import torch
    rows = {}
    for variant in a.variants:
        cold, restart, warm, hits = [], [], [], []
        for _ in range(a.repeats):
            with tempfile.TemporaryDirectory() as cache:
                c = run(variant, cache)
                r = run(variant, cache)
            cold.append(c["first_s"])
            restart.append(r["first_s"])
            warm.append(r["warm_first_s"])
            hits.append((r["fxgraph_hit"], r["fxgraph_miss"], r["aotautograd_hit"]))
        rows[variant] = {"cold_s": statistics.median(cold), "restart_s": statistics.median(restart),
                         "warm_s": statistics.median(warm), "restart_cache (fx hit, fx miss, aot hit)": hits[-1],
                         "runs": {"cold": cold, "restart": restart, "warm": warm}}
    md = [f"# First-step compile time (torch {torch.__version__}, depth-2 deit_tiny, N=32, "
          f"{os.environ.get('BENCH_THREADS', '2')} threads, median of {a.repeats})", "",
          "| variant | cold (s) | restart, cache on disk (s) | warm process, 2nd model (s) | restart: FX hits / misses / AOT hits |",
          "|---|---|---|---|---|"]
    for v, r in rows.items():
        h = r["restart_cache (fx hit, fx miss, aot hit)"]
        md.append(f"| {v} | {r['cold_s']:.1f} | {r['restart_s']:.1f} | {r['warm_s']:.1f} | {h[0]} / {h[1]} / {h[2]} |")
    c = rows.get("capskip")
    md.append("")
    for name in [v for v in ("plain", "plain_dynamic") if v in rows and c is not None]:
        p = rows[name]
        md.append(f"capskip / {name}: cold {c['cold_s'] / p['cold_s']:.2f}, restart {c['restart_s'] / p['restart_s']:.2f}, "
                  f"warm {c['warm_s'] / p['warm_s']:.2f}  ")
    if c is not None and "capskip_gather_graph" in rows:
        g = rows["capskip_gather_graph"]
        md.append(f"gather='graph' / capskip: cold {g['cold_s'] / c['cold_s']:.2f}, restart "
                  f"{g['restart_s'] / c['restart_s']:.2f}, warm {g['warm_s'] / c['warm_s']:.2f}  ")
    write_results(pathlib.Path(a.out), rows, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

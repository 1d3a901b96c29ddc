"""Why the eager gathers slow down under CPU contention: many parallel regions or many bytes (issue 32, item 6).

The kept rows' gathers of a selected deit_tiny backward (the shapes of ``gather_profile.py``'s table: img 32,
patch 4, N = 128, half the rows kept, scattered), timed three ways with the same bytes moved: as the runtime
does them (one ``index_select`` per saved tensor: 109 calls, the profile's 139 less its 30 smallest), as ONE ``index_select`` over a buffer as wide
as all of them together, and as one contiguous copy of that many bytes (no index).  Each at 1 and 2 intra-op
threads, first on the machine as it is, then beside a 2-thread matmul loop this script starts (and stops) in a
subprocess.  Interleaved round by round, medians of ``--rounds`` after 2.  -> benchmarks/results/<stem>.{md,json}

    python benchmarks/gathers_under_load.py
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

from capskip_fx.cpu import retain_freed_memory
from results_io import write_results

#: (row width, count) of the saved tensors a selected deit_tiny backward gathers (gather_profile.py's table;
#: the 1-row-wide and single tensors, under 0.4 ms together, left out)
SHAPES = [(49920, 24), (37440, 12), (12480, 36), (65 * 192, 25), (195, 12)]

LOOP = ("import torch; torch.set_num_threads(2); a = torch.randn(768, 768); b = torch.empty_like(a)\n"
        "while True: torch.mm(a, a, out=b)")


def arms(n: int, seed: int = 0) -> dict:
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:n // 2].sort().values
    xs = [torch.randn(n, w) for w, c in SHAPES for _ in range(c)]
    wide = torch.randn(n, sum(w * c for w, c in SHAPES))
    half = wide[: n // 2]
    out = torch.empty_like(half)  # the single calls write into it (a fresh 600 MB buffer would page-fault)
    return {
        "one index_select per tensor (the runtime's)": lambda: [torch.index_select(x, 0, idx) for x in xs],
        "one index_select, all bytes": lambda: torch.index_select(wide, 0, idx, out=out),
        "one contiguous copy, all bytes": lambda: out.copy_(half),
    }


def measure(fns: dict, threads: list[int], rounds: int) -> dict:
    times = {(a, t): [] for a in fns for t in threads}
    keys = list(times)
    for r in range(rounds + 2):
        for a, t in keys[r % len(keys):] + keys[: r % len(keys)]:  # rotated: no arm always first
            torch.set_num_threads(t)
            t0 = time.perf_counter()
            fns[a]()
            if r >= 2:
                times[(a, t)].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default="gathers_under_load")
    a = p.parse_args()
    retain_freed_memory()
    fns = arms(a.batch_size)
    load_before = os.getloadavg()[0]
    quiet = measure(fns, a.threads, a.rounds)
    loop = subprocess.Popen([sys.executable, "-c", LOOP])
    try:
        time.sleep(3)
        loaded = measure(fns, a.threads, a.rounds)
        load_during = os.getloadavg()[0]
    finally:
        loop.kill()
        loop.wait()
    rows = [{"arm": arm, "threads": t, "as_is_ms": round(quiet[(arm, t)], 2),
             "beside_loop_ms": round(loaded[(arm, t)], 2), "slowdown": round(loaded[(arm, t)] / quiet[(arm, t)], 2)}
            for arm in fns for t in a.threads]
    mb = 2 * 4 * (a.batch_size // 2) * sum(w * c for w, c in SHAPES) / 1e6
    md = [f"<!-- python benchmarks/gathers_under_load.py --rounds {a.rounds} --threads {' '.join(map(str, a.threads))} -->",
          "# The eager gathers beside a 2-thread matmul loop", "",
          f"N = {a.batch_size}, half the rows kept; {sum(c for _, c in SHAPES)} saved tensors, {mb:.0f} MB read and "
          f"written per gather pass; medians of {a.rounds} rounds after 2; load average {load_before:.1f} before, "
          f"{load_during:.1f} with the loop.", "",
          "| arm | threads | as is (ms) | beside the loop (ms) | slowdown |", "|---|---|---|---|---|"]
    md += [f"| {r['arm']} | {r['threads']} | {r['as_is_ms']:.1f} | {r['beside_loop_ms']:.1f} | {r['slowdown']:.2f}× |"
           for r in rows]
    write_results(pathlib.Path(__file__).parent / "results" / a.out,
                  {"rows": rows, "load_before": load_before, "load_during": load_during, "rounds": a.rounds},
                  "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

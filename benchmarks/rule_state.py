"""Per-step rule overhead against the dataset's size: SB and Stale-SB through the runtime's ``select`` (the
rule, its transaction, the one host read), at dataset sizes 10^4 and 10^6; one process, interleaved
round-robin, medians, warm-up excluded.  Every fourth step falls back (a non-finite h), so undoing is timed
too.  Also the copy of ``rule.state_dict()`` that each step made before steps were transactions.

    python benchmarks/rule_state.py --threads 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from datetime import datetime, timezone

import torch

from capskip_fx.rules import SelectiveBackprop, StaleSB
from capskip_fx.runtime.forwards import ForwardContext
from capskip_fx.runtime.state import RuntimeState


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n", type=int, default=256, help="batch size")
    p.add_argument("--c", type=int, default=100, help="classes")
    p.add_argument("--sizes", type=int, nargs="+", default=[10 ** 4, 10 ** 6])
    p.add_argument("--steps", type=int, default=400, help="timed steps per arm")
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore")  # the fallback steps' warning
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}, threads {a.threads}, load {os.getloadavg()}")
    g = torch.Generator().manual_seed(0)
    z = torch.randn(a.n, a.c, generator=g)
    y = torch.randint(0, a.c, (a.n,), generator=g)
    delta = (z.softmax(1) - torch.nn.functional.one_hot(y, a.c).float()) / a.n
    h = torch.randn(a.n, 8, generator=g)
    h_nan = h.clone()
    h_nan[0, 0] = float("nan")
    arms, idx_gen = {}, torch.Generator().manual_seed(1)
    for m in a.sizes:
        for name, rule in (("sb", SelectiveBackprop(prime_epochs=0)), ("stale_sb", StaleSB(prime_epochs=0, num_examples=m))):
            arms[f"{name} M={m:.0e}"] = (RuntimeState(rule), m)
    times = {k: [] for k in arms}
    copies = {k: [] for k in arms}
    names = list(arms)
    for step in range(a.steps + 20):
        for k in names[step % len(names):] + names[:step % len(names)]:
            state, m = arms[k]
            idx = torch.randint(0, m, (a.n,), generator=idx_gen)
            fwd = ForwardContext(targets=y, index=idx)
            t0 = time.perf_counter()
            state.select(h_nan if step % 4 == 3 else h, z, delta, fwd)
            dt = time.perf_counter() - t0
            t1 = time.perf_counter()
            state.rule.state_dict()  # what every step copied before
            dc = time.perf_counter() - t1
            if step >= 20:  # warm-up excluded
                times[k].append(dt)
                copies[k].append(dc)
    print(f"\nN = {a.n}, C = {a.c}, {a.steps} steps per arm (every 4th falls back)\n")
    print("| rule | dataset size | per-step select (us) | the state_dict() copy it no longer makes (us) |")
    print("|---|---|---|---|")
    for k in names:
        name, m = k.split(" M=")
        print(f"| {name} | {float(m):.0e} | {statistics.median(times[k]) * 1e6:.0f} | "
              f"{statistics.median(copies[k]) * 1e6:.0f} |")
    for name in ("sb", "stale_sb"):
        ks = [k for k in names if k.startswith(name + " ")]
        r = statistics.median(times[ks[-1]]) / statistics.median(times[ks[0]])
        print(f"{name}: per-step time at the largest size / the smallest = {r:.3f}")
    print(f"# load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

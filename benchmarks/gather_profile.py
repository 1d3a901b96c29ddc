"""How much of a selected-row backward is its gathers: torch.profiler over the forced rule's steps, the
kept rows' ``index_select``s grouped by the saved tensor's shape (issue 32, item 6: bwd(f)/bwd against
f + 0.03).

The step_time.py setting (timm deit_tiny, img 32, patch 4, N = 128, Inductor) and its forced rows (a random
``round(f N)`` of the batch, the same seed); one process, the dense compiled model and capskip_fx.compile's
alternating; backward times are medians over ``--steps`` unprofiled steps after ``--warmup``, the gathers
summed over one profiled step.  -> benchmarks/results/<stem>.{md,json}

    python benchmarks/gather_profile.py --threads 2
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import profile

import capskip_fx
from capskip_fx.cpu import retain_freed_memory
from capskip_fx.rules import Forced
from results_io import write_results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deit_tiny_patch16_224")
    p.add_argument("--img-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import timm

    torch.set_num_threads(a.threads)
    retain_freed_memory()
    torch.manual_seed(0)
    model = timm.create_model(a.model, pretrained=False, img_size=a.img_size, patch_size=a.patch_size, num_classes=100)
    n = a.batch_size
    x, y = torch.randn(n, 3, a.img_size, a.img_size), torch.randint(0, 100, (n,))
    keep = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:max(1, round(a.fraction * n))]
    dense = torch.compile(model, dynamic=True)
    cm = capskip_fx.compile(model, rule=Forced(keep=lambda _: keep))

    def step(f) -> float:
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(f(x), y)
        t0 = time.perf_counter()
        loss.backward()
        return time.perf_counter() - t0

    for _ in range(a.warmup):
        step(dense), step(cm)
    times: dict = {"dense": [], "selected": []}
    for _ in range(a.steps):
        times["dense"].append(step(dense))
        times["selected"].append(step(cm))
    st = capskip_fx.stats(cm)
    if st.mode != "selected":
        raise RuntimeError(f"the forced steps ran {st.mode!r}, not gathered")
    with profile(record_shapes=True) as prof:
        step(cm)
    gathers = sorted((e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::index_select"),
                     key=lambda e: -e.self_cpu_time_total)
    by_shape = [{"shape": e.input_shapes[0], "calls": e.count, "ms": e.self_cpu_time_total / 1e3} for e in gathers]
    total = sum(g["ms"] for g in by_shape)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    cmd = "python benchmarks/" + pathlib.Path(sys.argv[0]).name + " " + " ".join(sys.argv[1:])
    md = [f"<!-- {cmd} -->", "# The gathers of a selected-row backward", "",
          f"{a.model}, img {a.img_size}, patch {a.patch_size}, N = {n}, forced f = {a.fraction:g} ({keep.numel()} "
          f"rows), {a.threads} thread(s), median of {a.steps} steps after {a.warmup}.", "",
          f"Backward: dense {ms['dense']:.0f} ms, selected {ms['selected']:.0f} ms "
          f"(bwd(f)/bwd {ms['selected'] / ms['dense']:.3f}); the kept rows' gathers in one profiled selected step: "
          f"{total:.1f} ms ({total / ms['selected']:.1%} of the selected backward).", "",
          "| saved tensor (as gathered) | gathers | ms |", "|---|---|---|"]
    md += [f"| {g['shape']} | {g['calls']} | {g['ms']:.1f} |" for g in by_shape]
    print("\n".join(md))
    name = f"gather_profile_{a.model}_n{n}_f{round(a.fraction * 100)}pct_t{a.threads}"
    stem = pathlib.Path(a.out) if a.out else pathlib.Path(__file__).parent / "results" / name
    write_results(stem, {"args": vars(a), "median_ms": ms, "gathers_ms": total, "by_shape": by_shape,
                         "times_s": times}, "\n".join(md))


if __name__ == "__main__":
    main()

"""Host reads per steady-state training step, per rule, on any device (the GPU check runs it on CUDA).

Counts with capskip_fx.debug.count_host_reads (item/nonzero/mask-index/tolist, inside our ops too) and,
on CUDA, also the syncs torch itself reports (``torch.cuda.set_sync_debug_mode("warn")``).  A depth-2
deit_tiny (img 32, patch 4), N=32, steps 0-2 warm up (compile, verify, the VCAS probe), then the median
over 3 steps.  -> benchmarks/results/<device>_host_syncs.{md,json}

    python benchmarks/host_syncs.py [--device cuda] [--amp bf16] [--backend aot_eager]
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import warnings

import timm
import torch
import torch.nn.functional as F

import capskip_fx
from capskip_fx.debug import count_host_reads
from results_io import write_results

CASES = [  # (label, compile options, VCAS ratios to force after the probe or None)
    ("dense (torch.compile)", None, None),
    ("capskip b=0.3", dict(rule="capskip", budget=0.3), None),
    ("random keep=0.5", dict(rule="random", keep=0.5), None),
    ("forced keep=0.5", dict(rule="forced", keep=0.5), None),
    ("sb keep=0.5", dict(rule="sb", keep=0.5, start=0, end=1, interrupt=0), None),
    ("vcas (rho=nu=0.5)", dict(rule="vcas", vcas=capskip_fx.VCAS(freq=10 ** 9)), 0.5),
    ("capskip b=0.3 + vcas (rho=nu=0.5)", dict(rule="capskip", budget=0.3, vcas=capskip_fx.VCAS(freq=10 ** 9)), 0.5),
    ("vcas bernoulli (rho=nu=0.5)", dict(rule="vcas", vcas=capskip_fx.VCAS(freq=10 ** 9, sampler="bernoulli")), 0.5),
    # regional compile (capskip_fx.compile_regions): blocks chained directly take the next graph's rows;
    # the last block reaches the head through timm's eager final norm and pooling, so it reads its own
    ("random keep=0.5, regional", dict(rule="random", keep=0.5, regional=True), None),
    # (gather_below=1: at random init capskip keeps ~90 % of the rows, which otherwise run ungathered)
    ("capskip b=0.3, regional, gather_below=1", dict(rule="capskip", budget=0.3, gather_below=1.0, regional=True), None),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--amp", choices=["none", "bf16"], default="none")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--backend", default="inductor", help="inductor | aot_eager (same reads, faster compile)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.batch_size, 3, 32, 32, generator=g).to(dev)
    y = torch.randint(0, 10, (a.batch_size,), generator=g).to(dev)
    rows = []
    for label, opts, ratio in CASES:
        torch.manual_seed(0)
        model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4,
                                  num_classes=10, depth=2).to(dev)
        if opts is None:
            cm = torch.compile(model, backend=a.backend)
        elif opts.get("regional"):
            cm = capskip_fx.compile_regions(model, **{k: v for k, v in opts.items() if k != "regional"},
                                            backend=a.backend)
        else:
            cm = capskip_fx.compile(model, backend=a.backend, **opts)
        reads, syncs = [], []
        for step in range(6):
            model.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.amp == "bf16"):
                loss = F.cross_entropy(cm(x), y)
            if step == 1 and ratio is not None:
                for r in cm.backend.state.runners:
                    r.ctrl.rho, r.ctrl.nu = [ratio] * len(r.ctrl.rho), [ratio] * len(r.ctrl.nu)
            with warnings.catch_warnings(record=True) as w, count_host_reads() as ops:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    loss.backward()
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode(0)
            if step >= 3:
                reads.append(len(ops))
                syncs.append(sum("synchronizing" in str(m.message) for m in w))
        rows.append({"case": label, "reads": statistics.median(reads), "cuda_syncs": statistics.median(syncs) if cuda else None})
        print(rows[-1], flush=True)
    md = [f"# Host reads per steady-state step ({a.device}, {a.amp}, {a.backend}, torch {torch.__version__}, "
          f"depth-2 deit_tiny, N={a.batch_size})", "", "| case | host reads (count_host_reads) | CUDA syncs (sync debug mode) |", "|---|---|---|"]
    fmt = lambda v: "" if v is None else f"{v:g}"
    md += [f"| {r['case']} | {r['reads']:g} | {fmt(r['cuda_syncs'])} |" for r in rows]
    stem = pathlib.Path(a.out) if a.out else pathlib.Path(__file__).parent / "results" / f"{dev.type}_host_syncs"
    write_results(stem, rows, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

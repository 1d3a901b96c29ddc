"""Speed apart from accuracy: dense and rule training steps alternated in ONE process, on the
harness's model and data, reporting each rule's step-time ratio r to dense with a 95% interval.

    python benchmarks/interleaved.py                                   # CPU, a few minutes: digits, tiny ViT
    python benchmarks/interleaved.py --arms forced:keep=0.38 capskip:budget=0.5 -- \\
        --config configs/fashion_mnist_tiny.yaml --dataset mnist --initial-checkpoint PRE/checkpoint.pt --reset-head
    python benchmarks/interleaved.py --device cuda --amp bf16 -- --config configs/fashion_mnist_tiny.yaml \\
        --model deit_small_patch16_224 --depth 12 --embed-dim 384 --num-heads 6 --img-size 224 --patch-size 16

Everything after ``--`` is ``capskip-train`` flags: the model, data, batch size, initial weights and
optimizer are the harness's (:mod:`capskip_fx.train`), so the ratios are those of the experiment's
steps.  Each arm is its own copy of the model (same initial weights) with its own AdamW; every round
draws one batch from the train loader and runs every arm's full training step on it (forward,
backward, ``loss.item()``, the rule's stats read, ``opt.step()``), in an order that rotates by round.
The data loading is timed once per round and reported apart: it is the same for every arm.

Rounds are grouped into blocks; the first ``--warmup`` rounds (compiles) are left out.  Per block,
each arm's median step time over the reference's is one ratio; r is the mean of the blocks' ratios
with a 95% Student-t interval over blocks (and their median).  r vs dense likewise: the mean of the
per-block ratios to dense's median in the same block, its interval over the same values.  ``--threads``
(before ``--`` or among the capskip-train flags after it) sets torch's threads; the JSON records the
count used.  ``--at ARM=K`` also reports ARM's r at a share K of rows run: its own per-block ratio (its
selection cost included) moved along the forced:keep arms' per-block slope in the share of rows run.  The reference is ``torch.compile`` of
the plain model with the mean loss; ``dense`` is the harness's dense baseline (``capskip_fx.compile``,
rule dense), so the difference between the two is capskip_fx's own overhead.

Arms: ``NAME[:KEY=VALUE,...]`` with NAME a rule (its options, ``budget=`` for rules that take one), or
``infobatch`` (the dense model with InfoBatch's weighted per-sample loss and score update; its saving is
fewer steps per epoch, not cheaper steps: multiply r by the run's forwarded fraction for the epoch).
Each arm's kept fraction is measured over its timed steps.  Results: ``<out>.md`` and ``<out>.json``.
"""
from __future__ import annotations

import argparse
import copy
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
import yaml

import capskip_fx
from capskip_fx.cpu import retain_freed_memory
from capskip_fx.train import parse_config
from capskip_fx.train.data import load_data, make_loaders, resolve_device
from capskip_fx.train.infobatch import InfoBatchSampler
from capskip_fx.train.model import build_model, find_head
from capskip_fx.train.report import t_interval
from capskip_fx.train import checkpoint
from results_io import write_results

DEFAULT_TRAIN = ["--config", "configs/fashion_mnist_tiny.yaml", "--dataset", "digits", "--train-subset", "none",
                 "--batch-size", "128", "--check-every", "0"]
DEFAULT_ARMS = ["dense", "forced:keep=0.5", "random:keep=0.5", "sb:keep=0.5,start=0,end=1,interrupt=0", "capskip:budget=0.5", "kabena",
                "infobatch"]


def parse(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    train_argv = list(DEFAULT_TRAIN)
    if "--" in argv:
        i = argv.index("--")
        argv, train_argv = argv[:i], DEFAULT_TRAIN + argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, help="rules to time against the reference")
    p.add_argument("--blocks", type=int, default=8, help="timed blocks (the interval is over these)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per block (one step of every arm each)")
    p.add_argument("--warmup", type=int, default=3, help="rounds left out first (compiles)")
    p.add_argument("--device", default=None, help="overrides the harness's --device")
    p.add_argument("--amp", default=None, choices=["none", "bf16"], help="overrides the harness's --amp")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--at", nargs="+", default=[], metavar="ARM=K",
                   help="also report ARM's r at a share K of rows back-propagated (e.g. its training runs' share): "
                        "its own per-block ratio to dense, selection cost included, moved along the slope of the "
                        "forced:keep arms' step time in the share of rows run")
    p.add_argument("--out", default=None, help="results file stem (default benchmarks/results/interleaved_<device>_<model>)")
    a = p.parse_args(argv)
    cfg = parse_config(train_argv)
    cfg_threads = cfg.threads
    if a.threads is None:  # given after `--` (a capskip-train flag) it is honoured the same
        a.threads = cfg_threads
    elif cfg_threads is not None and cfg_threads != a.threads:
        p.error(f"--threads {a.threads} before `--` contradicts --threads {cfg_threads} after it")
    if a.device:
        train_argv += ["--device", a.device]
    if a.amp:
        train_argv += ["--amp", a.amp]
    if a.device or a.amp:
        cfg = parse_config(train_argv)
    if a.blocks < 2:
        p.error("--blocks must be >= 2 (the interval is over blocks)")
    a.specs = [(spec, *arm_spec(spec)) for spec in a.arms]  # bad arms fail before any data is loaded
    a.at_k = {}
    for item in a.at:
        arm, sep, k = item.rpartition("=")
        if not sep or arm not in a.arms:
            p.error(f"--at {item!r}: ARM=K with ARM one of --arms")
        a.at_k[arm] = float(k)
    if a.at_k and sum(name == "forced" for _, name, _ in a.specs) < 2:
        p.error("--at needs two or more forced:keep=... arms (the slope of step time in the rows run)")
    return a, cfg, train_argv


def arm_spec(spec: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = spec.partition(":")
    opts = {}
    for kv in filter(None, rest.split(",")):
        if "=" not in kv:
            raise SystemExit(f"--arms {spec!r}: options are KEY=VALUE, comma-separated")
        k, v = kv.split("=", 1)
        opts[k] = yaml.safe_load(v)
    if name == "stale_sb":
        raise SystemExit("--arms stale_sb: its saving is on the data side (rows dropped before the forward); "
                         "time it with benchmarks/step_time.py, which runs its filter")
    return name, opts


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vs_dense(rows: list[dict]) -> None:
    """Each arm's r over dense's (``vs_dense``: what step-matched runs are made with): the mean of the
    blocks' ratios to dense's in the same block (the pair shares each block's machine load), with its 95%
    interval over those same ratios, so the point estimate is the interval's centre; also their median
    (``vs_dense_median``) and the per-block ratios themselves (``vs_dense_blocks``)."""
    dense = next((r for r in rows if r["arm"] == "dense"), None)
    for r in rows:
        per = [a / d for a, d in zip(r["block_ratios"], dense["block_ratios"])] if dense else []
        r["vs_dense_blocks"] = per
        r["vs_dense"] = r["vs_dense_median"] = r["vs_dense_lo"] = r["vs_dense_hi"] = math.nan
        if per:
            r["vs_dense"] = statistics.fmean(per)
            r["vs_dense_median"] = statistics.median(per)
        if len(per) > 1:
            mean, half = t_interval(per)
            r["vs_dense_lo"], r["vs_dense_hi"] = mean - half, mean + half


def at_share(rows: list[dict], at_k: dict[str, float]) -> None:
    """``--at ARM=K``: ARM's r at a share K of rows run. Per block, the forced arms' ratios to dense give a
    least-squares slope in the share of rows run; ARM's block ratio (its selection cost included) moves along
    it from its own share in that block to K. r is the mean of those per-block values, with the 95% t
    interval over the same values; the slope (``slope``, per unit share) likewise."""
    forced = [r for r in rows if r["arm"].startswith("forced:")]
    if not at_k:
        return
    slopes = []
    for b in range(len(forced[0]["vs_dense_blocks"])):
        xs = [r["block_rows_frac"][b] for r in forced]
        ys = [r["vs_dense_blocks"][b] for r in forced]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slopes.append(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else math.nan)
    for r in rows:
        if r["arm"] not in at_k:
            continue
        k = at_k[r["arm"]]
        per = [v + s * (k - f) for v, s, f in zip(r["vs_dense_blocks"], slopes, r["block_rows_frac"])]
        mean, half = t_interval(per)
        smean, shalf = t_interval(slopes)
        r["at"] = {"k": k, "r": mean, "lo": mean - half, "hi": mean + half, "median": statistics.median(per),
                   "blocks": per, "slope": smean, "slope_lo": smean - shalf, "slope_hi": smean + shalf}


def main(argv=None) -> dict:
    a, cfg, train_argv = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        retain_freed_memory()
    torch.manual_seed(cfg.seed)
    data, cfg = load_data(cfg, device)
    model, cfg = build_model(cfg, data.num_classes)
    if cfg.initial_checkpoint:
        checkpoint.load_weights(model, find_head(model), checkpoint.read_weights(cfg.initial_checkpoint),
                                cfg.initial_checkpoint, reset_head=cfg.reset_head)
    model.to(device).train()
    loader, _, _ = make_loaders(cfg, data, device)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if cfg.amp == "bf16" else None

    def make_step(fwd: Callable, m: torch.nn.Module, loss_of: Callable, stats: bool) -> Callable:
        from timm.optim import create_optimizer_v2

        opt = create_optimizer_v2(m, "adamw", lr=cfg.lr, weight_decay=cfg.weight_decay)
        kept, rows_run = [], []

        def step(x, y, idx, idx_cpu):
            opt.zero_grad(set_to_none=True)
            sync(device)
            t0 = time.perf_counter()
            with (autocast() if autocast else torch.autocast(device.type, enabled=False)):
                loss = loss_of(fwd, x, y, idx, idx_cpu)
            loss.backward()
            loss.item()
            if stats:
                st = capskip_fx.stats(fwd)
                kept.append(int(st.kept) / max(int(st.n), 1))
                rows_run.append(int(st.rows) / max(int(st.n), 1))
            else:
                kept.append(1.0)
                rows_run.append(1.0)
            opt.step()
            sync(device)
            return time.perf_counter() - t0

        step.kept, step.rows_run = kept, rows_run
        return step

    def mean_ce(fwd, x, y, idx, idx_cpu):
        return F.cross_entropy(fwd(x, capskip_targets=y, capskip_index=idx), y)

    def plain_ce(fwd, x, y, idx, idx_cpu):
        return F.cross_entropy(fwd(x), y)

    arms: dict[str, Callable] = {}
    plain = copy.deepcopy(model)
    arms["torch.compile"] = make_step(torch.compile(plain, backend=cfg.backend), plain, plain_ce, stats=False)
    for spec, name, opts in a.specs:
        opts = dict(opts)
        m = copy.deepcopy(model)
        if name == "infobatch":
            ib = InfoBatchSampler(len(data.train), cfg.epochs, cfg.infobatch_ratio, cfg.infobatch_delta, seed=cfg.seed)
            # a pruned epoch's weights: a random half of the samples kept at 1/(1-r)
            ib.weights[torch.randperm(ib.n, generator=torch.Generator().manual_seed(0))[: ib.n // 2]] = 1 / ib.keep_ratio

            def weighted(fwd, x, y, idx, idx_cpu, ib=ib):
                per = F.cross_entropy(fwd(x, capskip_targets=y, capskip_index=idx).float(), y, reduction="none")
                ib.update(idx_cpu, per.detach())
                return (per * ib.weights_for(idx_cpu).to(x.device)).mean()

            cm = capskip_fx.compile(m, rule="dense", backend=cfg.backend, seed=cfg.seed)
            arms[spec] = make_step(cm, m, weighted, stats=True)
        else:
            budget = opts.pop("budget", cfg.budget)
            cm = capskip_fx.compile(m, rule=name, budget=budget, backend=cfg.backend, seed=cfg.seed, **opts)
            arms[spec] = make_step(cm, m, mean_ce, stats=True)
        cm.train()

    names = list(arms)
    times: dict[str, list[list[float]]] = {n: [] for n in names}  # per block, per round
    data_s: list[float] = []
    it = iter(loader)
    total = a.warmup + a.blocks * a.rounds
    print(f"[interleaved] {len(names)} arms x {total} rounds ({a.warmup} warm-up) on {cfg.model} "
          f"({cfg.dataset}, N={cfg.batch_size}, {device}, backend {cfg.backend})", flush=True)
    t_start = time.perf_counter()
    for r in range(total):
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        x, y, idx = (t.to(device, non_blocking=True) for t in batch)
        sync(device)
        block = (r - a.warmup) // a.rounds
        if r >= a.warmup:
            data_s.append(time.perf_counter() - t0)
            if (r - a.warmup) % a.rounds == 0:
                for n in names:
                    times[n].append([])
        order = names[r % len(names):] + names[: r % len(names)]  # rotate: no arm always runs first
        for n in order:
            dt = arms[n](x, y, idx, batch[2])
            if r >= a.warmup:
                times[n][block].append(dt)
            elif r == a.warmup - 1:
                arms[n].kept.clear()  # measured keep: timed steps only
                arms[n].rows_run.clear()
        if r == a.warmup - 1 or r == total - 1:
            print(f"[interleaved] round {r + 1}/{total}, {time.perf_counter() - t_start:.0f} s", flush=True)

    ref = [statistics.median(b) for b in times["torch.compile"]]
    rows = []
    for n in names:
        med = [statistics.median(b) for b in times[n]]
        ratios = [m / rr for m, rr in zip(med, ref)]
        mean, half = t_interval(ratios)
        kept = arms[n].kept
        rows.append({"arm": n, "kept_frac": statistics.fmean(kept) if kept else math.nan,
                     "step_ms": 1e3 * statistics.median([t for b in times[n] for t in b]),
                     "ratio": mean, "ratio_lo": mean - half, "ratio_hi": mean + half,
                     "ratio_median": statistics.median(ratios), "block_ratios": ratios,
                     "rows_frac": statistics.fmean(arms[n].rows_run) if arms[n].rows_run else math.nan,
                     "block_rows_frac": [statistics.fmean(arms[n].rows_run[b * a.rounds:(b + 1) * a.rounds])
                                         for b in range(a.blocks)]})
    vs_dense(rows)
    at_share(rows, a.at_k)
    env = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "threads_asked": a.threads,
           "machine": platform.machine(), "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "model": cfg.model, "dataset": cfg.dataset, "batch_size": cfg.batch_size, "amp": cfg.amp,
           "backend": cfg.backend, "blocks": a.blocks, "rounds": a.rounds, "warmup": a.warmup,
           "data_ms_median": 1e3 * statistics.median(data_s), "train_argv": train_argv,
           "wall_s": time.perf_counter() - t_start}
    cmd = "python benchmarks/interleaved.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = [f"`{cmd}`", "", f"# Interleaved step time: {cfg.model} on {cfg.dataset}, N={cfg.batch_size}, {device}",
          "",
          f"{env['gpu'] or platform.machine()}, torch {torch.__version__}, {env['threads']} threads, amp {cfg.amp}, "
          f"backend {cfg.backend}; {a.blocks} blocks x {a.rounds} rounds after {a.warmup} warm-up rounds, every arm "
          f"once per round on the same batch, order rotating. r: each block's median step time over "
          f"torch.compile's, mean over blocks [95% t interval] (median of blocks). A step is forward, backward, "
          f"loss.item(), the stats read and AdamW's step; data loading ({env['data_ms_median']:.1f} ms per batch, "
          f"median) is the same for every arm and not in it. r vs dense (what step-matched runs are made with): "
          f"the mean of the blocks' ratios of the arm's median step to dense's in the same block [95% t interval "
          f"over the same ratios] (their median).",
          "",
          "| arm | kept (measured) | step ms (median) | r vs torch.compile [95% CI] | median of blocks | r vs dense [95% CI] "
          "| median of blocks |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['arm']} | {r['kept_frac']:.3f} | {r['step_ms']:.1f} | {r['ratio']:.3f} "
                  f"[{r['ratio_lo']:.3f}, {r['ratio_hi']:.3f}] | {r['ratio_median']:.3f} | {r['vs_dense']:.3f} "
                  f"[{r['vs_dense_lo']:.3f}, {r['vs_dense_hi']:.3f}] | {r['vs_dense_median']:.3f} |")
    at = [r for r in rows if "at" in r]
    if at:
        md += ["", "r at a given share of rows run (`--at`): the arm's own block ratios to dense (its selection "
                   "cost included), moved along the forced arms' per-block slope in the share of rows run "
                   f"({at[0]['at']['slope']:+.3f} [{at[0]['at']['slope_lo']:+.3f}, {at[0]['at']['slope_hi']:+.3f}] "
                   "per unit share); mean over blocks [95% t interval] (median).", "",
               "| arm | rows run (measured) | at share | r vs dense [95% CI] | median of blocks |", "|---|---|---|---|---|"]
        for r in at:
            t = r["at"]
            md.append(f"| {r['arm']} | {r['rows_frac']:.3f} | {t['k']:.3f} | {t['r']:.3f} [{t['lo']:.3f}, {t['hi']:.3f}] "
                      f"| {t['median']:.3f} |")
    md += ["", "infobatch: per-step cost; its saving is fewer steps per epoch (multiply r by the run's forwarded "
               "fraction)."]
    text = "\n".join(md)
    print(text)
    stem = Path(a.out) if a.out else Path(__file__).parent / "results" / f"interleaved_{device.type}_{cfg.model}"
    write_results(stem, {"env": env, "rows": rows}, text)
    print(f"written to {stem}.md / .json")
    return {"env": env, "rows": rows}


if __name__ == "__main__":
    main()

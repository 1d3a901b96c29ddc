"""The training loop: one run from a TrainConfig, its per-step / per-epoch logs, evaluation and
the learning-rate schedule."""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

import capskip_fx
from capskip_fx.rules import build_rule
from capskip_fx.cpu import retain_freed_memory

from . import checkpoint, plots, report
from .checks import CompileClock, distortion_check
from .config import TrainConfig, rule_options, write_yaml
from .data import load_data, make_loaders, resolve_device
from .model import build_model, check_pretrained, find_head


def lr_at(cfg: TrainConfig, progress: float) -> float:
    """Linear warm-up to ``lr`` over warmup_epochs/epochs of progress, then cosine to ``min_lr``."""
    p = min(max(progress, 0.0), 1.0)
    w = min(cfg.warmup_epochs / cfg.epochs, 1.0)
    if p < w:
        return cfg.lr * p / w
    if w >= 1.0:
        return cfg.lr
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * (p - w) / (1 - w)))


def _finite(x: Any) -> Any:
    """JSON-safe number: NaN/inf become null."""
    if isinstance(x, torch.Tensor):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _vcas_log(v: Optional[dict]) -> Optional[dict]:
    """The step's VCAS state, compact: probe step?, s, mean rho / nu, mean rows per segment."""
    if not v:
        return None
    mean = lambda xs: statistics.mean(xs) if xs else 1.0
    return {"probe": v["probe"], "s": v["s"], "rho": mean(v["rho"]), "nu": mean(v["nu"]),
            "rows": mean(v["segment_rows"])}


@torch.no_grad()
def evaluate(model: nn.Module, loader, device, autocast) -> tuple[float, float]:
    """Top-1 (%) and mean loss, in eval mode, through the eager model."""
    was = model.training
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y, _ in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            z = model(x)
        loss_sum += F.cross_entropy(z.float(), y, reduction="sum").item()
        correct += (z.argmax(1) == y).sum().item()
        total += y.numel()
    model.train(was)
    return 100.0 * correct / max(total, 1), loss_sum / max(total, 1)


SUMMARY_FIELDS = ("epoch", "steps", "train_loss", "eval_top1", "eval_loss", "wall_clock_s", "compile_s",
                  "backward_rows", "rows", "rows_seen", "mean_kept_frac", "lr", "checks", "violations", "fallbacks",
                  "time_budget_hit")
#: rows: forwarded (every step's batch); rows_seen: drawn from the data (more under Stale-SB's filter)
COUNTERS = ("step", "backward_rows", "rows", "checks", "violations", "fallbacks")


def _carry_lines(src: Path, dst: Path, before_step: int) -> None:
    """A resumed run's log: the lines of steps before the checkpoint (a crash after it wrote more)."""
    kept = []
    if src.exists():
        for line in src.read_text().splitlines():
            try:
                if json.loads(line)["step"] < before_step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):  # a line cut short by the crash
                pass
    dst.write_text("".join(kept))


def train(cfg: TrainConfig) -> dict[str, Any]:
    """One run.  Returns the final result (also written to ``result.json``)."""
    from tqdm.auto import tqdm

    # everything that can fail on a path or the network does so before the data is loaded
    ck = checkpoint.load_for_resume(cfg.resume) if cfg.resume else None
    if ck is not None and ck["epoch"] >= cfg.epochs:
        raise SystemExit(f"--resume {cfg.resume}: the run already finished epoch {ck['epoch']} of {cfg.epochs}; "
                         f"pass --epochs N > {ck['epoch']} to train on")
    init_sd = checkpoint.read_weights(cfg.initial_checkpoint) if cfg.initial_checkpoint and ck is None else None
    pretrained = cfg.pretrained and ck is None  # a resumed run's weights come from its checkpoint
    if pretrained:
        check_pretrained(cfg.model)

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        retain_freed_memory()  # the gathers' fresh buffers would page-fault in every step (capskip_fx/cpu.py)

    data, cfg = load_data(cfg, device)
    model, cfg = build_model(cfg, data.num_classes, pretrained=pretrained)
    cfg = dataclasses.replace(cfg, label=report.run_label(dataclasses.asdict(cfg)),
                              out=cfg.out or f"runs/{cfg.dataset}-{cfg.rule}-s{cfg.seed}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    write_yaml(cfg, out / "config.yaml")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[run] {cfg.label} seed {cfg.seed}: {cfg.model} ({n_params:,} params) on {device}, "
          f"backend {cfg.backend}, out {out}")

    head = find_head(model)
    if init_sd is not None:
        checkpoint.load_weights(model, head, init_sd, cfg.initial_checkpoint, reset_head=cfg.reset_head)
    model.to(device)
    vcas = capskip_fx.VCAS(**cfg.vcas_options) if cfg.vcas_options is not None else None
    stale = None  # Stale-SB: one rule object for the model and the loader's filter (its data side)
    if cfg.rule == "stale_sb":
        stale = build_rule("stale_sb", cfg.budget, {"num_examples": len(data.train), **rule_options(cfg)})
    train_loader, eval_loader, gen = make_loaders(cfg, data, device, stale_rule=stale)
    stale_filter = train_loader.batch_sampler.filter if stale is not None else None
    steps_per_epoch = len(train_loader)  # under Stale-SB an upper bound: dropped rows shorten epochs
    total_steps = cfg.epochs * steps_per_epoch
    cm = capskip_fx.compile(model, rule=stale or cfg.rule, budget=cfg.budget, backend=cfg.backend, seed=cfg.seed,
                            vcas=vcas, **({} if stale else rule_options(cfg, total_steps)))
    cm.train()
    from timm.optim import create_optimizer_v2  # AdamW without decay on biases/norms/tokens

    opt = create_optimizer_v2(model, "adamw", lr=cfg.lr, weight_decay=cfg.weight_decay)
    log_every = cfg.log_every or max(1, steps_per_epoch // 10)

    def autocast():
        if cfg.amp == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    clock = CompileClock()
    step, backward_rows, rows, checks, violations, fallbacks = 0, 0, 0, 0, 0, 0
    prev_variants, hit_budget, first_step = None, False, True
    summary: list[dict[str, Any]] = []
    start_epoch = 0
    log_mode = "w"
    if ck is not None:
        cm.load_state_dict(ck["model"])  # weights + the rule's state
        opt.load_state_dict(ck["optimizer"])
        clock.load_state_dict(ck["clock"])
        step, backward_rows, rows, checks, violations, fallbacks = (ck["counters"][k] for k in COUNTERS)
        if stale_filter is not None:
            stale_filter.load_state_dict(ck["stale_filter"])
        summary = list(ck["summary"])
        start_epoch = ck["epoch"]
        src = Path(cfg.resume).parent
        for name in ("steps.jsonl", "checks.jsonl"):
            _carry_lines(src / name, out / name, step)
        log_mode = "a"
        if cfg.workers > 0:
            print("[resume] with --workers > 0 the augmentation draws of persistent workers restart: "
                  "close to, not bit-exact with, an uninterrupted run", file=sys.stderr)
        checkpoint.set_rng_state(ck["rng"], gen)  # last: nothing above may draw from them
        print(f"[resume] {cfg.resume}: epoch {start_epoch}, step {step}, wall {clock.wall_s:.1f}s")
        del ck
    tol_limit = cfg.budget + cfg.check_tol

    def rows_seen() -> int:
        return stale_filter.n_seen if stale_filter is not None else rows

    lr = lr_at(cfg, step / total_steps)
    with open(out / "steps.jsonl", log_mode) as steps_f, open(out / "checks.jsonl", log_mode) as checks_f:
        for epoch in range(start_epoch + 1, cfg.epochs + 1):
            ep_loss, ep_kept_frac, ep_steps, ep_rows, ep_wall0 = 0.0, 0.0, 0, 0, clock.wall_s
            cm.set_epoch(epoch - 1)
            if stale_filter is not None:
                train_loader.batch_sampler.set_epoch(epoch - 1)
            bar = tqdm(train_loader, desc=f"epoch {epoch}/{cfg.epochs}", disable=None, leave=True, dynamic_ncols=True)
            t_prev = time.perf_counter()
            for x, y, idx in bar:
                x, y, idx = (t.to(device, non_blocking=True) for t in (x, y, idx))
                t0 = time.perf_counter()
                data_s = t0 - t_prev
                progress = (step + 1) / total_steps
                if stale_filter is not None:  # epochs shrink as rows are dropped: progress through the data
                    progress = stale_filter.n_seen / (cfg.epochs * len(data.train))
                if cfg.time_budget and cfg.schedule_by_time:
                    progress = max(progress, clock.wall_s / cfg.time_budget)
                lr = lr_at(cfg, progress)
                for group in opt.param_groups:
                    group["lr"] = lr
                do_check = cfg.check_every > 0 and (step + 1) % cfg.check_every == 0
                rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None) \
                    if do_check else None
                opt.zero_grad(set_to_none=True)
                with autocast():
                    logits = cm(x, capskip_targets=y, capskip_index=idx)
                    loss = F.cross_entropy(logits, y)
                loss.backward()
                st = capskip_fx.stats(cm)
                loss_v = loss.item()
                sync()
                t1 = time.perf_counter()
                if not math.isfinite(loss_v):
                    raise FloatingPointError(f"non-finite loss {loss_v} at step {step} (epoch {epoch})")
                kept, n = int(st.kept), int(st.n)
                bound = _finite(st.bound)
                if do_check:
                    chk = distortion_check(model, head, x, y, autocast, rng)
                    checks += 1
                    violation = bool(cfg.rule == "capskip" and chk["rel_l2_head"] > tol_limit)
                    violations += violation
                    if violation:
                        print(f"[check] step {step}: capskip head rel-L2 {chk['rel_l2_head']:.6g} > budget "
                              f"{cfg.budget} (+{cfg.check_tol}); rule bound {bound}", file=sys.stderr)
                    checks_f.write(json.dumps({"step": step, "epoch": epoch, "kept": kept, "n": n, "bound": bound,
                                               **{k: _finite(v) for k, v in chk.items()},
                                               "violation": violation}) + "\n")
                    checks_f.flush()
                t2 = time.perf_counter()
                opt.step()
                sync()
                t3 = time.perf_counter()
                step_s = (t1 - t0) + (t3 - t2)
                variants = st.variants
                # this process's first step compiles, also when it resumes mid-run
                is_compile = first_step or (prev_variants is not None and variants > prev_variants)
                prev_variants, first_step = variants, False
                clock.add(data_s, step_s, is_compile)
                fallback = st.fallback
                fallbacks += fallback is not None
                backward_rows += kept
                rows += n
                ep_loss += loss_v
                ep_kept_frac += kept / max(n, 1)
                ep_steps += 1
                ep_rows += n
                steps_f.write(json.dumps({
                    "step": step, "epoch": epoch, "loss": loss_v, "kept": kept, "n": n, "bound": bound,
                    "rows_run": st.rows, "lr": lr, "step_time_s": step_s, "data_time_s": data_s, "compile_step": is_compile,
                    "variants": variants, "fallback": fallback,
                    "selection_ms": _finite(st.selection_ms), "vcas": _vcas_log(st.vcas)}) + "\n")
                step += 1
                ep_wall = clock.wall_s - ep_wall0
                ips = ep_rows / ep_wall if ep_wall > 0 else float("nan")
                if bar.disable:
                    if ep_steps % log_every == 0 or ep_steps == steps_per_epoch:
                        print(f"epoch {epoch} step {ep_steps}/{steps_per_epoch} loss {ep_loss / ep_steps:.4f} "
                              f"kept {ep_kept_frac / ep_steps:.3f} img/s {ips:.0f} lr {lr:.2e}", flush=True)
                else:
                    bar.set_postfix(loss=f"{ep_loss / ep_steps:.4f}", kept=f"{ep_kept_frac / ep_steps:.3f}",
                                    img_s=f"{ips:.0f}", refresh=False)
                if cfg.time_budget and clock.wall_s >= cfg.time_budget:
                    hit_budget = True
                    break
                t_prev = time.perf_counter()
            bar.close()
            steps_f.flush()
            checks_f.flush()
            top1, eval_loss = evaluate(model, eval_loader, device, autocast)
            summary.append({
                "epoch": epoch, "steps": step, "train_loss": ep_loss / max(ep_steps, 1), "eval_top1": top1,
                "eval_loss": eval_loss, "wall_clock_s": clock.wall_s, "compile_s": clock.compile_s,
                "backward_rows": backward_rows, "rows": rows, "rows_seen": rows_seen(),
                "mean_kept_frac": ep_kept_frac / max(ep_steps, 1),
                "lr": lr, "checks": checks, "violations": violations, "fallbacks": fallbacks,
                "time_budget_hit": int(hit_budget)})
            with open(out / "summary.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
                w.writeheader()
                w.writerows(summary)
            checkpoint.save({
                "format": checkpoint.FORMAT, "epoch": epoch, "model": cm.state_dict(), "optimizer": opt.state_dict(),
                # the schedule is a function of these (and of the clock under --time-budget)
                "schedule": {"step": step, "total_steps": total_steps, "lr": lr},
                "counters": dict(zip(COUNTERS, (step, backward_rows, rows, checks, violations, fallbacks))),
                "clock": clock.state_dict(), "summary": summary, "rng": checkpoint.rng_state(gen),
                "stale_filter": stale_filter.state_dict() if stale_filter is not None else None,
                "config": dataclasses.asdict(cfg)}, out / checkpoint.FILENAME)
            print(f"[epoch {epoch}] train_loss {summary[-1]['train_loss']:.4f} eval_top1 {top1:.2f}% "
                  f"wall {clock.wall_s:.1f}s compile {clock.compile_s:.1f}s kept {summary[-1]['mean_kept_frac']:.3f}"
                  + (f" violations {violations}" if violations else ""), flush=True)
            if hit_budget:
                print(f"[run] time budget {cfg.time_budget:.1f}s reached after {step} steps (epoch {epoch})")
                break

    result = {"out": str(out), "label": cfg.label, "seed": cfg.seed, "final_top1": summary[-1]["eval_top1"],
              "wall_clock_s": clock.wall_s, "compile_s": clock.compile_s, "steps": step,
              "kept_frac": backward_rows / max(rows, 1), "backward_rows": backward_rows,
              "forward_frac": rows / max(rows_seen(), 1), "checks": checks,
              "violations": violations, "fallbacks": fallbacks, "time_budget_hit": hit_budget,
              "data_source": data.source, "n_params": n_params, "torch": torch.__version__,
              "resumed_from": cfg.resume}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    plots.plot_runs([report.load_run(out)], out)
    return result

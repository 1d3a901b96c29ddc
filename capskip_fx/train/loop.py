"""The training loop: one run from a TrainConfig, its per-step / per-epoch logs, evaluation and
the learning-rate schedule.

:class:`RunState` holds a run (model, optimizer, loaders, clock, counters); :func:`train` drives it:
``begin_epoch`` / ``step`` per batch / ``end_epoch``, then ``finish``."""
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

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import nn

import capskip_fx
from capskip_fx.rules import build_rule
from capskip_fx.cpu import retain_freed_memory

from . import checkpoint, plots, report
from .checks import CompileClock, distortion_check
from .config import TrainConfig, model_rule, rule_options, uses_infobatch, write_yaml
from .data import load_data, make_loaders, resolve_device
from .model import build_model, check_pretrained, find_head, loss_fn


def lr_at(cfg: TrainConfig, progress: float) -> float:
    """Linear warm-up to ``lr`` over warmup_epochs/epochs of progress, then (``cfg.schedule``) cosine to
    ``min_lr`` (also "truncated": its progress runs over the full epochs, see RunState), or constant until
    the last ``decay_frac`` of progress and linear to ``min_lr`` over it ("linear")."""
    p = min(max(progress, 0.0), 1.0)
    w = min(cfg.warmup_epochs / cfg.epochs, 1.0)
    if p < w:
        return cfg.lr * p / w
    if w >= 1.0:
        return cfg.lr
    if cfg.schedule == "linear":
        start = max(w, 1.0 - cfg.decay_frac)
        if p <= start:
            return cfg.lr
        return cfg.lr + (cfg.min_lr - cfg.lr) * (p - start) / (1.0 - start)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * (p - w) / (1 - w)))


def budget_batch_size(n_train: int, epochs: int, max_steps: int) -> int:
    """The largest batch whose ``epochs`` epochs (incomplete last batches dropped) hold ``max_steps`` steps:
    a run of max_steps steps then spans about ``epochs`` epochs, its last one cut short."""
    for b in range(max(1, n_train * epochs // max_steps), 0, -1):
        if epochs * (n_train // b) >= max_steps:
            return b
    return 1


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
def evaluate(model: nn.Module, loader, device, autocast, loss=F.cross_entropy) -> tuple[float, float]:
    """Top-1 (%) and mean loss, in eval mode, through the eager model (per token for ``--task lm``)."""
    was = model.training
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y, _ in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            z = model(x)
        loss_sum += loss(z.float(), y, reduction="sum").item()
        correct += (z.argmax(-1) == y).sum().item()
        total += y.numel()
    model.train(was)
    return 100.0 * correct / max(total, 1), loss_sum / max(total, 1)


SUMMARY_FIELDS = ("epoch", "steps", "train_loss", "eval_top1", "eval_loss", "wall_clock_s", "compile_s",
                  "backward_rows", "rows", "rows_seen", "mean_kept_frac", "lr", "checks", "violations", "fallbacks",
                  "time_budget_hit", "rows_run")


@dataclasses.dataclass
class Counters:
    """The run's running totals; a checkpoint carries them (under ``counters``)."""
    step: int = 0
    backward_rows: int = 0  # kept rows (nonzero weight)
    rows_run: int = 0  # rows the backward ran on: kept plus padding, or all n (stats().rows)
    rows: int = 0  # forwarded (every step's batch); rows_seen: drawn from the data (more under Stale-SB's filter)
    checks: int = 0
    violations: int = 0
    fallbacks: int = 0


COUNTERS = tuple(f.name for f in dataclasses.fields(Counters))


@dataclasses.dataclass
class EpochStats:
    """The current epoch's sums, for its summary row and the progress display."""
    loss: float = 0.0
    kept_frac: float = 0.0
    steps: int = 0
    rows: int = 0
    wall0: float = 0.0  # the clock's wall_s when the epoch began


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


#: config keys that do not change what a run computes: a run started again with other values is the same run
_SAME_RUN_KEYS = {"out", "resume", "threads", "workers", "device", "data_dir", "log_every", "label"}
#: what a run writes: cleared when the same run starts again from scratch (a crash would leave the old ones)
_RUN_FILES = ("result.json", "summary.csv", "steps.jsonl", "checks.jsonl", "checkpoint.pt")


def _claim_run_dir(cfg: TrainConfig, out: Path) -> None:
    """A fresh run's folder: refused if it holds another run (its config differs in what the run computes:
    two runs' files would mix, and compare would read one under the other's label); the same run started
    again from scratch starts from an empty folder's worth of results."""
    old_file = out / "config.yaml"
    if not old_file.is_file() or not any((out / name).exists() for name in _RUN_FILES):
        return  # no run there, or one that stopped before its first step: nothing of it to mix with
    old = yaml.safe_load(old_file.read_text()) or {}
    new = yaml.safe_load(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    differ = [k for k in new if k not in _SAME_RUN_KEYS and old.get(k) != new[k]]
    if differ:
        shown = ", ".join(f"{k} {old.get(k)!r} -> {new[k]!r}" for k in differ[:4]) + (" ..." if len(differ) > 4 else "")
        raise SystemExit(f"--out {out} holds another run ({old.get('label')}; {shown}): pass another --out, or "
                         f"--resume {out / 'checkpoint.pt'} to continue that run, or remove the folder")
    for name in _RUN_FILES:
        (out / name).unlink(missing_ok=True)


def _preflight(cfg: TrainConfig) -> tuple[Optional[dict], Optional[dict], bool]:
    """(checkpoint to resume, initial weights, fetch pretrained?): everything that can fail on a path or
    the network does so before the data is loaded."""
    ck = checkpoint.load_for_resume(cfg.resume) if cfg.resume else None
    if ck is not None and cfg.max_steps and ck["counters"]["step"] >= cfg.max_steps:
        raise SystemExit(f"--resume {cfg.resume}: the run already made its {cfg.max_steps} steps (--max-steps)")
    spent = ck["config"].get("time_budget") if ck is not None else None
    if ck is not None and cfg.time_budget and spent and cfg.time_budget <= spent and ck["summary"] \
            and int(ck["summary"][-1].get("time_budget_hit") or 0):
        raise SystemExit(f"--resume {cfg.resume}: the run already spent its time budget of {spent:g} s "
                         f"(--time-budget); pass --time-budget S > {spent:g} to train on")
    if ck is not None and not cfg.max_steps and ck["epoch"] >= cfg.epochs:
        raise SystemExit(f"--resume {cfg.resume}: the run already finished epoch {ck['epoch']} of {cfg.epochs}; "
                         f"pass --epochs N > {ck['epoch']} to train on")
    init_sd = checkpoint.read_weights(cfg.initial_checkpoint) if cfg.initial_checkpoint and ck is None else None
    pretrained = cfg.pretrained and ck is None  # a resumed run's weights come from its checkpoint
    if pretrained:
        check_pretrained(cfg.model)
    return ck, init_sd, pretrained


class RunState:
    """One run: built (or resumed) from a config, then advanced by :meth:`step` and :meth:`end_epoch`.

    A context manager: the per-step logs are open inside ``with``.  Everything the next epoch depends on
    is in :meth:`checkpoint_state`, written at each epoch end."""

    def __init__(self, cfg: TrainConfig):
        ck, init_sd, pretrained = _preflight(cfg)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)  # the harness draws none; a timm or user transform may (checkpointed as well)
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device)
        if self.device.type == "cpu":
            retain_freed_memory()  # the gathers' fresh buffers would page-fault in every step (capskip_fx/cpu.py)
        self._build(cfg, init_sd, pretrained)

        # the run's progress: what a checkpoint carries
        self.clock = CompileClock()
        self.counters = Counters()
        self.summary: list[dict[str, Any]] = []
        self.epochs_done = 0
        # this process's own (not in a checkpoint)
        self.epoch = 0  # the epoch in progress (1-based)
        self.ep = EpochStats()
        self.bar = None
        self.t_prev = 0.0  # when the wait for the next batch began
        self.prev_variants: Optional[int] = None
        self.first_step = True  # this process's first step compiles, also when it resumes mid-run
        self.hit_budget = False
        self.hit_steps = False
        self.log_mode = "w"
        if ck is not None:
            self._resume(ck)
        self.tol_limit = self.cfg.budget + self.cfg.check_tol
        self.lr = lr_at(self.cfg, self.counters.step / self.schedule_steps)

    def _build(self, cfg: TrainConfig, init_sd: Optional[dict], pretrained: bool) -> None:
        """Data, model, loaders, the compiled model and the optimizer; the resolved config in ``out``."""
        device = self.device
        data, cfg = load_data(cfg, device)
        if cfg.budget_batch:
            cfg = dataclasses.replace(cfg, batch_size=budget_batch_size(len(data.train), cfg.epochs, cfg.max_steps))
        model, cfg = build_model(cfg, data.num_classes, pretrained=pretrained)
        cfg = dataclasses.replace(cfg, label=report.run_label(dataclasses.asdict(cfg)),
                                  out=cfg.out or f"runs/{cfg.dataset}-{cfg.rule}-s{cfg.seed}")
        self.cfg, self.data, self.model = cfg, data, model
        out = self.out = Path(cfg.out)
        if cfg.resume is None:
            _claim_run_dir(cfg, out)
        out.mkdir(parents=True, exist_ok=True)
        write_yaml(cfg, out / "config.yaml")
        self.n_params = sum(p.numel() for p in model.parameters())
        print(f"[run] {cfg.label} seed {cfg.seed}: {cfg.model} ({self.n_params:,} params) on {device}, "
              f"backend {cfg.backend}, out {out}")

        self.head = find_head(model)
        self.loss = loss_fn(cfg)
        if init_sd is not None:
            checkpoint.load_weights(model, self.head, init_sd, cfg.initial_checkpoint, reset_head=cfg.reset_head)
        model.to(device)
        vcas = capskip_fx.VCAS(**cfg.vcas_options) if cfg.vcas_options is not None else None
        stale = None  # Stale-SB: one rule object for the model and the loader's filter (its data side)
        if cfg.rule == "stale_sb":
            stale = build_rule("stale_sb", cfg.budget, {"num_examples": len(data.train), **rule_options(cfg)})
        self.train_loader, self.eval_loader, self.gen = make_loaders(cfg, data, device, stale_rule=stale)
        self.stale_filter = self.train_loader.batch_sampler.filter if stale is not None else None
        self.infobatch = self.train_loader.sampler if uses_infobatch(cfg) else None
        self.steps_per_epoch = len(self.train_loader)  # under Stale-SB an upper bound: dropped rows shorten epochs
        self.total_steps = cfg.epochs * self.steps_per_epoch
        self.n_epochs = cfg.epochs  # epochs to iterate; a step-matched run takes as many as its steps need
        self.schedule_steps = self.total_steps  # the steps the learning-rate schedule spans
        if cfg.max_steps:
            self.total_steps = cfg.max_steps
            self.n_epochs = max(1, -(-cfg.max_steps // max(self.steps_per_epoch, 1)))
            if cfg.schedule != "truncated":
                self.schedule_steps = cfg.max_steps
        self.cm = capskip_fx.compile(model, rule=stale or model_rule(cfg), budget=cfg.budget, backend=cfg.backend,
                                     seed=cfg.seed, vcas=vcas, **({} if stale else rule_options(cfg, self.total_steps)))
        self.cm.train()
        from timm.optim import create_optimizer_v2  # AdamW without decay on biases/norms/tokens

        self.opt = create_optimizer_v2(model, "adamw", lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.log_every = cfg.log_every or max(1, self.steps_per_epoch // 10)
        self.keep_counts = None
        if cfg.keep_counts_of:  # random at another run's per-step counts (same seed: same batches)
            with open(Path(cfg.keep_counts_of) / "steps.jsonl") as f:
                self.keep_counts = [json.loads(line)["kept"] for line in f]

    def _resume(self, ck: dict[str, Any]) -> None:
        cfg = self.cfg
        self.cm.load_state_dict(ck["model"])  # weights + the rule's state
        self.opt.load_state_dict(ck["optimizer"])
        self.clock.load_state_dict(ck["clock"])
        self.counters = Counters(**{k: ck["counters"][k] for k in COUNTERS if k in ck["counters"]})  # older: no rows_run
        if self.stale_filter is not None:
            self.stale_filter.load_state_dict(ck["stale_filter"])
        if self.infobatch is not None:
            self.infobatch.load_state_dict(ck["infobatch"])
        self.summary = list(ck["summary"])
        self.epochs_done = ck["epoch"]
        src = Path(cfg.resume).parent
        if not (src / "steps.jsonl").is_file():  # a checkpoint copied out of its run: the log is the run's
            src = self.out
        for name in ("steps.jsonl", "checks.jsonl"):
            _carry_lines(src / name, self.out / name, self.counters.step)
        self.log_mode = "a"
        if cfg.workers > 0:
            print("[resume] with --workers > 0 the augmentation draws of persistent workers restart: "
                  "close to, not bit-exact with, an uninterrupted run", file=sys.stderr)
        checkpoint.set_rng_state(ck["rng"], self.gen)  # last: nothing above may draw from them
        print(f"[resume] {cfg.resume}: epoch {self.epochs_done}, step {self.counters.step}, wall {self.clock.wall_s:.1f}s")
        cut = ck.get("epoch_cut")
        if cut:
            print(f"[resume] epoch {self.epochs_done} stopped after {cut['steps']} of its {cut['of']} steps; the run goes "
                  f"on with epoch {self.epochs_done + 1}: the rest of epoch {self.epochs_done}'s batches are not "
                  f"trained on", file=sys.stderr)

    def __enter__(self) -> "RunState":
        self.steps_f = open(self.out / "steps.jsonl", self.log_mode)
        self.checks_f = open(self.out / "checks.jsonl", self.log_mode)
        return self

    def __exit__(self, *exc) -> None:
        self.steps_f.close()
        self.checks_f.close()

    def autocast(self):
        if self.cfg.amp == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def rows_seen(self) -> int:
        if self.infobatch is not None:
            return self.infobatch.n_seen
        return self.stale_filter.n_seen if self.stale_filter is not None else self.counters.rows

    def begin_epoch(self, epoch: int):
        """Start ``epoch`` (1-based); returns its batches (a progress bar over the train loader)."""
        from tqdm.auto import tqdm

        self.epoch = epoch
        self.ep = EpochStats(wall0=self.clock.wall_s)
        self.cm.set_epoch(epoch - 1)
        if self.stale_filter is not None:
            self.train_loader.batch_sampler.set_epoch(epoch - 1)
        if self.infobatch is not None:
            self.infobatch.set_epoch(epoch - 1)
        self.bar = tqdm(self.train_loader, desc=f"epoch {epoch}/{self.n_epochs}", disable=None, leave=True,
                        dynamic_ncols=True)
        self.t_prev = time.perf_counter()
        return self.bar

    def _progress(self) -> float:
        """The schedule's position at the coming step, in [0, 1]."""
        cfg, step = self.cfg, self.counters.step
        progress = (step + 1) / self.schedule_steps
        if self.stale_filter is not None:  # epochs shrink as rows are dropped: progress through the data
            progress = self.stale_filter.n_seen / (cfg.epochs * len(self.data.train))
        if self.infobatch is not None:  # pruned epochs are shorter: each epoch is 1/epochs of the schedule
            progress = (self.epoch - 1 + (self.ep.steps + 1) / max(len(self.train_loader), 1)) / cfg.epochs
        if cfg.time_budget and cfg.schedule_by_time:
            progress = max(progress, self.clock.wall_s / cfg.time_budget)
        return progress

    def step(self, batch) -> bool:
        """Train on one batch of the epoch; False once the time budget is reached (end the epoch)."""
        cfg, c, ep, epoch, device = self.cfg, self.counters, self.ep, self.epoch, self.device
        x, y, idx = (t.to(device, non_blocking=True) for t in batch)
        t0 = time.perf_counter()
        data_s = t0 - self.t_prev
        lr = self.lr = lr_at(cfg, self._progress())
        for group in self.opt.param_groups:
            group["lr"] = lr
        do_check = cfg.check_every > 0 and (c.step + 1) % cfg.check_every == 0
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None) \
            if do_check else None
        self.opt.zero_grad(set_to_none=True)
        if self.keep_counts is not None:
            if c.step >= len(self.keep_counts):
                raise SystemExit(f"--keep-counts-of {cfg.keep_counts_of}: it logged {len(self.keep_counts)} steps, "
                                 f"this run is at step {c.step + 1}")
            self.cm.rule.keep = max(1, self.keep_counts[c.step]) / x.shape[0]
        # InfoBatch's weights and scores live on the host: index them with the loader's CPU indices
        weights = self.infobatch.weights_for(batch[2]).to(device) if self.infobatch is not None else None
        with self.autocast():
            # an LM's targets are per token: the rules read them from the in-graph loss, not capskip_targets
            logits = self.cm(x, capskip_targets=y if y.dim() == 1 else None, capskip_index=idx)
            if weights is None:
                loss = self.loss(logits, y)
            else:  # InfoBatch: kept low-loss samples weigh 1/(1-r); scores from the unweighted losses
                per = self.loss(logits.float(), y, reduction="none")
                self.infobatch.update(batch[2], per.detach())
                loss = (per * weights).mean()
        loss.backward()
        st = capskip_fx.stats(self.cm)
        # the logged loss is the unweighted mean, comparable with the other rules' (InfoBatch's weights
        # are up to 1/(1-r))
        loss_v = (loss if weights is None else per.detach().mean()).item()
        self._sync()
        t1 = time.perf_counter()
        if not math.isfinite(loss_v):
            raise FloatingPointError(f"non-finite loss {loss_v} at step {c.step} (epoch {epoch})")
        kept, n = int(st.kept), int(st.n)
        bound = _finite(st.bound)
        if do_check:
            self._check(x, y, rng, kept, n, bound, weights)
        t2 = time.perf_counter()
        self.opt.step()
        self._sync()
        t3 = time.perf_counter()
        step_s = (t1 - t0) + (t3 - t2)
        variants = st.variants
        is_compile = self.first_step or (self.prev_variants is not None and variants > self.prev_variants)
        self.prev_variants, self.first_step = variants, False
        self.clock.add(data_s, step_s, is_compile)
        fallback = st.fallback
        c.fallbacks += fallback is not None
        c.backward_rows += kept
        c.rows_run += int(st.rows) if st.rows is not None else n
        c.rows += n
        ep.loss += loss_v
        ep.kept_frac += kept / max(n, 1)
        ep.steps += 1
        ep.rows += n
        self.steps_f.write(json.dumps({
            "step": c.step, "epoch": epoch, "loss": loss_v, "kept": kept, "n": n, "bound": bound,
            "rows_run": st.rows, "lr": lr, "step_time_s": step_s, "data_time_s": data_s, "compile_step": is_compile,
            "variants": variants, "fallback": fallback,
            "selection_ms": _finite(st.selection_ms), "vcas": _vcas_log(st.vcas)}) + "\n")
        c.step += 1
        self._show_progress()
        if cfg.time_budget and self.clock.wall_s >= cfg.time_budget:
            self.hit_budget = True
            return False
        if cfg.max_steps and c.step >= cfg.max_steps:
            self.hit_steps = True
            return False
        self.t_prev = time.perf_counter()
        return True

    def _check(self, x, y, rng, kept: int, n: int, bound, weights=None) -> None:
        """The exact distortion check of this step's batch, logged to ``checks.jsonl``."""
        cfg, c = self.cfg, self.counters
        chk = distortion_check(self.model, self.head, x, y, self.autocast, rng, weights, self.loss)
        c.checks += 1
        violation = bool(model_rule(cfg) == "capskip" and chk["rel_l2_head"] > self.tol_limit)
        c.violations += violation
        if violation:
            print(f"[check] step {c.step}: capskip head rel-L2 {chk['rel_l2_head']:.6g} > budget "
                  f"{cfg.budget} (+{cfg.check_tol}); rule bound {bound}", file=sys.stderr)
        self.checks_f.write(json.dumps({"step": c.step, "epoch": self.epoch, "kept": kept, "n": n, "bound": bound,
                                        **{k: _finite(v) for k, v in chk.items()},
                                        "violation": violation}) + "\n")
        self.checks_f.flush()

    def _show_progress(self) -> None:
        ep, bar = self.ep, self.bar
        ep_wall = self.clock.wall_s - ep.wall0
        ips = ep.rows / ep_wall if ep_wall > 0 else float("nan")
        if bar.disable:
            if ep.steps % self.log_every == 0 or ep.steps == self.steps_per_epoch:
                of = ("<=" if self.stale_filter is not None or self.infobatch is not None else "") \
                    + str(self.steps_per_epoch)  # data-side selection shortens epochs: an upper bound
                print(f"epoch {self.epoch} step {ep.steps}/{of} loss {ep.loss / ep.steps:.4f} "
                      f"kept {ep.kept_frac / ep.steps:.3f} img/s {ips:.0f} lr {self.lr:.2e}", flush=True)
        else:
            bar.set_postfix(loss=f"{ep.loss / ep.steps:.4f}", kept=f"{ep.kept_frac / ep.steps:.3f}",
                            img_s=f"{ips:.0f}", refresh=False)

    def end_epoch(self) -> bool:
        """Evaluate, write the summary row and the checkpoint; False once the run should stop (time budget)."""
        cfg, c, ep, epoch, clock = self.cfg, self.counters, self.ep, self.epoch, self.clock
        self.bar.close()
        self.steps_f.flush()
        self.checks_f.flush()
        top1, eval_loss = evaluate(self.model, self.eval_loader, self.device, self.autocast, self.loss)
        self.summary.append({
            "epoch": epoch, "steps": c.step, "train_loss": ep.loss / max(ep.steps, 1), "eval_top1": top1,
            "eval_loss": eval_loss, "wall_clock_s": clock.wall_s, "compile_s": clock.compile_s,
            "backward_rows": c.backward_rows, "rows_run": c.rows_run, "rows": c.rows, "rows_seen": self.rows_seen,
            "mean_kept_frac": ep.kept_frac / max(ep.steps, 1),
            "lr": self.lr, "checks": c.checks, "violations": c.violations, "fallbacks": c.fallbacks,
            "time_budget_hit": int(self.hit_budget)})
        with open(self.out / "summary.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
            w.writeheader()
            w.writerows(self.summary)
        self.epochs_done = epoch
        checkpoint.save(self.checkpoint_state(), self.out / checkpoint.FILENAME)
        print(f"[epoch {epoch}] train_loss {self.summary[-1]['train_loss']:.4f} eval_top1 {top1:.2f}% "
              f"wall {clock.wall_s:.1f}s compile {clock.compile_s:.1f}s kept {self.summary[-1]['mean_kept_frac']:.3f}"
              + (f" violations {c.violations}" if c.violations else ""), flush=True)
        if self.hit_budget:
            print(f"[run] time budget {cfg.time_budget:g} s reached after {c.step} steps (epoch {epoch})")
            return False
        if self.hit_steps:
            print(f"[run] {cfg.max_steps} steps made (--max-steps), epoch {epoch}")
            return False
        return True

    def checkpoint_state(self) -> dict[str, Any]:
        """What ``--resume`` needs to continue after the last finished epoch."""
        c = self.counters
        return {
            "format": checkpoint.FORMAT, "epoch": self.epochs_done, "model": self.cm.state_dict(),
            "optimizer": self.opt.state_dict(),
            # the schedule is a function of these (and of the clock under --time-budget)
            "schedule": {"step": c.step, "total_steps": self.total_steps, "lr": self.lr},
            "counters": dataclasses.asdict(c),
            "clock": self.clock.state_dict(), "summary": self.summary, "rng": checkpoint.rng_state(self.gen),
            "stale_filter": self.stale_filter.state_dict() if self.stale_filter is not None else None,
            "infobatch": self.infobatch.state_dict() if self.infobatch is not None else None,
            # an epoch that --max-steps / --time-budget stopped early: a resume starts the next one
            "epoch_cut": ({"steps": self.ep.steps, "of": self.steps_per_epoch}
                          if (self.hit_steps or self.hit_budget) and self.ep.steps < self.steps_per_epoch else None),
            "config": dataclasses.asdict(self.cfg)}

    def finish(self) -> dict[str, Any]:
        """The final result, written to ``result.json``, and the run's plots."""
        cfg, c, out = self.cfg, self.counters, self.out
        result = {"out": str(out), "label": cfg.label, "seed": cfg.seed, "final_top1": self.summary[-1]["eval_top1"],
                  "wall_clock_s": self.clock.wall_s, "compile_s": self.clock.compile_s, "steps": c.step,
                  "kept_frac": c.backward_rows / max(c.rows, 1), "backward_rows": c.backward_rows, "rows_run": c.rows_run,
                  "forward_frac": c.rows / max(self.rows_seen, 1), "checks": c.checks,
                  "violations": c.violations, "fallbacks": c.fallbacks, "time_budget_hit": self.hit_budget,
                  "max_steps": cfg.max_steps, "steps_of": cfg.steps_of, "ratio": cfg.ratio,
                  "data_source": self.data.source, "n_params": self.n_params, "torch": torch.__version__,
                  "resumed_from": cfg.resume}
        (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        plots.plot_runs([report.load_run(out)], out)
        return result


def train(cfg: TrainConfig) -> dict[str, Any]:
    """One run.  Returns the final result (also written to ``result.json``)."""
    run = RunState(cfg)
    with run:
        for epoch in range(run.epochs_done + 1, run.n_epochs + 1):
            for batch in run.begin_epoch(epoch):
                if not run.step(batch):
                    break
            if not run.end_epoch():
                break
    return run.finish()

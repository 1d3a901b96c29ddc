"""Step-time benchmark: dense compiled vs capskip's selected-row backward, the naive alternatives
and every rule, in ONE process, interleaved round-robin, warm-up (compile) excluded, medians.

    python benchmarks/step_time.py                       # CPU default: deit_tiny img 32 patch 4, N=128
    python benchmarks/step_time.py --device cuda --model deit_small_patch16_224 --img-size 224 \
        --patch-size 16 --batch-size 256 --amp bf16 --fractions 1 0.5 0.35
    python benchmarks/step_time.py --fractions 1 0.5 --rules --vcas 1,1 0.5,1 1,0.5 0.5,0.5 \
        --out benchmarks/results/cpu_deit_tiny_patch16_224_img32_n128_vcas     # VCAS, its own process

Rows: dense = torch.compile(inductor, dynamic batch) with mean CE; capskip f = forced keep fraction
on the capskip-compiled model (the rule is swapped, the graphs are the same); "loss masking" =
dense backward of the masked loss; "2nd forward" = no-grad forward on N, then forward+backward on
the kept subset (Composer/SB style).  Rules run on labels where --correct-frac of the rows are the
model's own predictions (a mid-training-like batch; the random-init model is otherwise ~1/C right).
ideal = (F + f*B) / (F + B) with the dense F and B.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path


import torch
import torch.nn.functional as F

import capskip_fx
from capskip_fx.dynamo_entry import backend_of
from capskip_fx.cpu import retain_freed_memory
from results_io import write_results
from capskip_fx.rules.stale_sb_filter import StaleBatchFilter
from capskip_fx.rules import CAPSkip, Forced, RandomSkip, Rule, StaleSB, make_rule


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deit_tiny_patch16_224")
    p.add_argument("--img-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=4)
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    p.add_argument("--rules", nargs="*", default=["capskip", "random", "sb", "stale_sb", "kabena", "ub"])
    p.add_argument("--vcas", nargs="*", default=[],
                   help="VCAS settings 'rho,nu[,sampler]' (fixed ratios: every cut rho, every sampled matmul nu; "
                        "sampler systematic (default) or bernoulli), e.g. "
                        "1,1 0.5,1 1,0.5 0.5,0.5 0.5,0.5,bernoulli; run them in their own process (--rules --fractions 1 0.5): "
                        "a second compiled model with different allocation sizes slows the others' gathers")
    p.add_argument("--gather", choices=["eager", "graph"], default="eager",
                   help="the capskip model's row gather (eager, the default; graph: a second compiled backward that gathers its own kept rows)")
    p.add_argument("--mode", default=None,
                   help="torch.compile mode for dense and capskip alike (reduce-overhead: CUDA graphs, capskip buckets=8)")
    p.add_argument("--regional", action="store_true",
                   help="also a regionally compiled copy (capskip_fx.compile_regions: blocks and head in place)")
    p.add_argument("--compare-gather", action="store_true",
                   help="also time the forced rows with the other gather, on a second compiled model")
    p.add_argument("--flop-draws", type=int, default=3, help="aot_eager backwards counted per VCAS setting")
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--correct-frac", type=float, default=0.7)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", choices=["none", "bf16"], default="none")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="results file stem (default benchmarks/results/<device>_<model>)")
    p.add_argument("--lm", action="store_true",
                   help="a tiny causal LM (transformers GPT-2 config, loss from labels= with padding) instead of the "
                        "timm model: sequences are the rows; rows forced f, the rules, and the CAPSkip selection's cost")
    p.add_argument("--lm-embd", type=int, default=64)
    p.add_argument("--lm-layers", type=int, default=2)
    p.add_argument("--lm-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--sketch", type=int, default=None, help="CAPSkip's sketch width (None: auto; 0: exact)")
    p.add_argument("--no-malloc-tuning", action="store_true",
                   help="leave glibc malloc's defaults (else capskip_fx.cpu.retain_freed_memory on CPU)")
    return p.parse_args()


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main():
    a = parse()
    malloc_tuned = not a.no_malloc_tuning and not a.device.startswith("cuda") and retain_freed_memory()
    if a.lm:
        return main_lm(a, malloc_tuned)
    import timm

    if a.threads:
        torch.set_num_threads(a.threads)
    dev = a.device
    kw = dict(pretrained=False, img_size=a.img_size, patch_size=a.patch_size, num_classes=a.num_classes)
    if a.depth:
        kw["depth"] = a.depth
    torch.manual_seed(0)
    model = timm.create_model(a.model, **kw).to(dev)
    n = a.batch_size
    x = torch.randn(n, 3, a.img_size, a.img_size, device=dev)
    with torch.no_grad():
        pred = model(x).argmax(1)
    y = torch.randint(0, a.num_classes, (n,), device=dev)
    right = torch.rand(n, generator=torch.Generator().manual_seed(0)) < a.correct_frac
    y[right.to(dev)] = pred[right.to(dev)]
    amp = torch.autocast(device_type=dev.split(":")[0], dtype=torch.bfloat16) if a.amp == "bf16" else None

    dense = torch.compile(model, dynamic=True, mode=a.mode)
    cm = capskip_fx.compile(model, rule="dense", gather=a.gather, mode=a.mode)
    other = {"graph": "eager", "eager": "graph"}[a.gather]
    cm_g = capskip_fx.compile(model, rule="dense", gather=other, mode=a.mode) if a.compare_gather else None
    owner = {}  # variant -> the compiled model whose stats it reports (default cm)
    reg = None
    if a.regional:  # a copy: in-place compiles would change the model the other variants compile
        reg = copy.deepcopy(model)
        capskip_fx.compile_regions(reg, rule="dense", gather=a.gather, **({"mode": a.mode} if a.mode else {}))

    forwarded = {}  # variant -> fraction of the batch forwarded (Stale-SB drops rows before it)

    def step(fwd, loss_fn, bwd=True):
        model.zero_grad(set_to_none=True)
        sync(dev)
        t0 = time.perf_counter()
        with (amp or torch.autocast(device_type="cpu", enabled=False)):
            loss = loss_fn(fwd)
        sync(dev)
        t1 = time.perf_counter()
        if bwd:
            loss.backward()
        sync(dev)
        return t1 - t0, time.perf_counter() - t1

    mean_ce = lambda f: F.cross_entropy(f(x), y)
    variants = {"dense compiled": lambda: step(dense, mean_ce)}
    for f in a.fractions:
        k = max(1, round(f * n))
        keep = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:k].to(dev)
        mask = torch.zeros(n, device=dev)
        mask[keep] = 1

        def run_forced(keep=keep):
            cm.rule = Forced(keep=lambda _: keep)
            return step(cm, mean_ce)

        def run_masked(mask=mask):
            return step(dense, lambda f: (F.cross_entropy(f(x), y, reduction="none") * mask).sum() / n)

        def run_second(keep=keep):
            sync(dev)
            t0 = time.perf_counter()
            with torch.no_grad(), (amp or torch.autocast(device_type="cpu", enabled=False)):
                dense(x)
            sync(dev)
            sel = time.perf_counter() - t0
            fw, bw = step(dense, lambda f: F.cross_entropy(f(x[keep]), y[keep], reduction="sum") / n)
            return fw + sel, bw

        variants[f"capskip forced f={f:g}"] = run_forced
        if reg is not None:
            def run_regional(keep=keep):
                backend = backend_of(reg)  # made by its first (warm-up) step, with the dense rule
                if backend is not None:
                    backend.state.rule = Forced(keep=lambda _: keep)
                reg.zero_grad(set_to_none=True)
                return step(reg, mean_ce)
            variants[f"capskip regional f={f:g}"] = run_regional
            owner[f"capskip regional f={f:g}"] = reg
        if cm_g is not None:
            def run_other(keep=keep):
                cm_g.rule = Forced(keep=lambda _: keep)
                return step(cm_g, mean_ce)
            variants[f"capskip forced f={f:g} {other} gather"] = run_other
            owner[f"capskip forced f={f:g} {other} gather"] = cm_g
        if f < 1:
            variants[f"loss masking f={f:g}"] = run_masked
            variants[f"2nd forward f={f:g}"] = run_second
    rules = {}
    for r in a.rules:
        if r == "capskip":
            rules[r] = CAPSkip(budget=a.budget)
        elif r == "random":
            rules[r] = RandomSkip(match=CAPSkip(budget=a.budget))
        else:
            rules[r] = make_rule(r)
    for name, rule in rules.items():
        label = f"rule {name}" + (f" b={a.budget:g}" if name in ("capskip", "random") else "")

        def run_rule(rule=rule):
            cm.rule = rule
            return step(cm, mean_ce)

        if isinstance(rule, StaleSB):
            # epoch 0 (warm-up) fills the loss cache; timed rounds are epoch 1, where cached
            # losses are fresh and the filter drops rows before the forward
            filt, index = StaleBatchFilter(rule), torch.arange(n, device=dev)
            cm.rule = rule
            cm.set_epoch(0)
            F.cross_entropy(cm(x, capskip_index=index), y).backward()

            def run_rule(rule=rule, filt=filt, index=index, label=label):
                cm.rule = rule
                cm.set_epoch(1)
                keep = filt(index, 1)
                forwarded.setdefault(label, []).append(float(keep.float().mean()))
                xs, ys, ids = x[keep], y[keep], index[keep]
                return step(cm, lambda f: F.cross_entropy(f(xs, capskip_index=ids), ys))
        variants[label] = run_rule

    vcas_settings = [vcas_setting(v) for v in a.vcas]
    if vcas_settings:
        # VCAS has its own graphs (segments); fixed ratios (its controller adapts over hundreds of steps)
        cm_v = capskip_fx.compile(model, rule="vcas", vcas=capskip_fx.VCAS(freq=10 ** 9))
        for setting in vcas_settings:
            def run_vcas(setting=setting):
                set_ratios(cm_v, *setting)
                out = step(cm_v, mean_ce)
                vcas_rows.setdefault(setting, []).append(capskip_fx.stats(cm_v).vcas)
                return out
            variants[vcas_label(setting)] = run_vcas
    vcas_rows: dict = {}

    def observe(v):
        st, ours = capskip_fx.stats(owner.get(v, cm)), v.startswith(("capskip", "rule"))
        return (st.kept / st.n, st.selection_ms) if ours else (None, None)
    times, kept, sel_ms, t_compile = interleave(variants, a.warmup, a.reps, observe)

    med = lambda xs: statistics.median(xs)
    F0 = med([t[0] for t in times["dense compiled"]])
    B0 = med([t[1] for t in times["dense compiled"]])
    rows = []
    for v in variants:
        fw, bw = med([t[0] for t in times[v]]), med([t[1] for t in times[v]])
        kf = med(kept[v]) if kept[v][0] is not None else (float(v.split("f=")[1].split()[0]) if "f=" in v else 1.0)
        fr = med(forwarded[v]) if v in forwarded else 1.0
        kf = kf * fr  # rows back-propagated, as a fraction of the full batch
        rows.append({"variant": v, "kept": kf, "forwarded": fr, "fwd_ms": fw * 1e3, "bwd_ms": bw * 1e3, "bwd_ratio": bw / B0,
                     "selection_ms": med(sel_ms[v]) if sel_ms[v][0] is not None else None,
                     "step_ratio": (fw + bw) / (F0 + B0), "ideal": (fr * F0 + kf * B0) / (F0 + B0)})
        rows[-1]["vs_ideal"] = rows[-1]["step_ratio"] / rows[-1]["ideal"]
    vcas_table = vcas_flops(model, x, y, vcas_settings, a, amp) if vcas_settings else []
    for r in vcas_table:
        w = next(x for x in rows if x["variant"] == r["variant"])
        r.update(wall_bwd_ratio=w["bwd_ratio"], wall_step_ratio=w["step_ratio"])
        r["segment_rows"] = [statistics.mean(col) for col in zip(*(v["segment_rows"] for v in vcas_rows[r["setting"]]))]
    fmt = lambda v: "" if v is None else f"{v:.2f}"
    hdr = ("| variant | forwarded | kept | fwd ms | bwd ms | bwd/bwd_dense | selection ms | step ratio | ideal | vs ideal |\n"
           "|---|---|---|---|---|---|---|---|---|---|")
    lines = [hdr] + [f"| {r['variant']} | {r['forwarded']:.2f} | {r['kept']:.2f} | {r['fwd_ms']:.0f} | {r['bwd_ms']:.0f} | {r['bwd_ratio']:.2f} | "
                     f"{fmt(r['selection_ms'])} | "
                     f"{r['step_ratio']:.2f} | {r['ideal']:.2f} | {r['vs_ideal']:.2f} |" for r in rows]
    device = torch.cuda.get_device_name() if dev.startswith("cuda") else f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    meta = {"device": device, "malloc_tuned": malloc_tuned, "torch": torch.__version__, "model": a.model, "img_size": a.img_size,
            "patch_size": a.patch_size, "batch_size": n, "amp": a.amp, "reps": a.reps, "warmup": a.warmup,
            "budget": a.budget, "gather": a.gather, "mode": a.mode, "correct_frac": a.correct_frac, "warmup_s": t_compile,
            "command": "python " + " ".join(sys.argv)}
    if vcas_table:
        lines += ["", "VCAS: backward FLOPs counted from the executed graph (aot_eager twin, FlopCounterMode, "
                  f"mean of {a.flop_draws} draws) vs wall-clock (Inductor, above); total = fwd + bwd FLOPs.", "",
                  "| variant | bwd GFLOP | bwd FLOP ratio | total FLOP ratio | VCAS accounting | bwd wall ratio | step wall ratio |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['variant']} | {r['bwd_gflop']:.1f} | {r['bwd_flop_ratio']:.2f} | {r['total_flop_ratio']:.2f} | "
                  f"{r['vcas_accounting']:.2f} | {r['wall_bwd_ratio']:.2f} | {r['wall_step_ratio']:.2f} |" for r in vcas_table]
    table = "\n".join(lines)
    print(f"# {a.model} img {a.img_size} patch {a.patch_size}, N={n}, {a.amp}, {device}, torch {torch.__version__}; "
          f"median of {a.reps} interleaved rounds, warm-up excluded ({t_compile:.0f} s)\n")
    print(table)
    stem = Path(a.out) if a.out else Path(__file__).parent / "results" / f"{dev.split(':')[0]}_{a.model}_img{a.img_size}_n{n}"
    for r in vcas_table:
        r["setting"] = list(r["setting"])
    write_results(stem, {"meta": meta, "rows": rows, "vcas": vcas_table}, f"{json.dumps(meta)}\n\n{table}")


class _Recording(Rule):
    """A rule that delegates and keeps the last HeadView (to time the selection alone, synchronised)."""

    def __init__(self, rule):
        self.rule, self.view = rule, None
        self.name, self.needs_labels = rule.name, rule.needs_labels

    def state_dict(self):
        return self.rule.state_dict()

    def load_state_dict(self, state):
        self.rule.load_state_dict(state)

    def select(self, view):
        self.view = view
        return self.rule.select(view)


def interleave(variants: dict, warmup: int, reps: int, observe) -> tuple[dict, dict, dict, float]:
    """Warm every variant up (compiles; its seconds returned apart), then ``reps`` rounds calling each in turn.
    ``observe(v)`` after each timed call gives (kept fraction, selection ms).  Returns per-variant lists of
    the calls' results, kept fractions and selection ms, and the warm-up seconds."""
    times, kept, sel_ms = ({v: [] for v in variants} for _ in range(3))
    t0 = time.perf_counter()
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    t_compile = time.perf_counter() - t0
    for _ in range(reps):
        for v, fn in variants.items():
            times[v].append(fn())
            k, ms = observe(v)
            kept[v].append(k)
            sel_ms[v].append(ms)
    return times, kept, sel_ms, t_compile


def main_lm(a, malloc_tuned: bool) -> None:
    """A tiny causal LM: GPT-2 config (tied embeddings), Hugging Face's loss from labels= (a quarter of the
    sequences padded by a quarter, -100).  Rows: dense compiled, capskip forced f (bwd(f)/bwd(dense), expected
    <= f + 0.05), the rules, and CAPSkip's selection alone (synchronised, median) as a fraction of the dense
    step."""
    import transformers

    if a.threads:
        torch.set_num_threads(a.threads)
    dev, n, t = a.device, a.batch_size, a.seq_len
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=a.vocab, n_positions=max(t, 16), n_embd=a.lm_embd, n_layer=a.lm_layers,
                                  n_head=a.lm_heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).to(dev)
    model.loss_type = "ForCausalLM"  # else a logged warning breaks the graph before the loss (both paths work)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.long)
    mask[: n // 4, -(t // 4):] = 0
    labels = ids.masked_fill(mask == 0, -100)
    ids, mask, labels = ids.to(dev), mask.to(dev), labels.to(dev)
    amp = torch.autocast(device_type=dev.split(":")[0], dtype=torch.bfloat16) if a.amp == "bf16" else None
    cm = capskip_fx.compile(model, rule="dense", gather=a.gather, mode=a.mode)
    # compiled first: after dense's dynamic=True compile of the same forward, Dynamo would make the sequence
    # length symbolic too, and a saved (N*T, d) value with a symbolic T runs dense-masked (docs/limits.md)
    cm(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    dense = torch.compile(model, dynamic=True, mode=a.mode)

    def step(fwd):
        model.zero_grad(set_to_none=True)
        sync(dev)
        t0 = time.perf_counter()
        with (amp or torch.autocast(device_type="cpu", enabled=False)):
            loss = fwd(input_ids=ids, attention_mask=mask, labels=labels).loss
        sync(dev)
        t1 = time.perf_counter()
        loss.backward()
        sync(dev)
        return t1 - t0, time.perf_counter() - t1

    variants = {"dense compiled": lambda: step(dense)}
    for f in a.fractions:
        keep = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:max(1, round(f * n))].to(dev)

        def run_forced(keep=keep):
            cm.rule = Forced(keep=lambda _: keep)
            return step(cm)
        variants[f"capskip forced f={f:g}"] = run_forced
    rules = {}
    for r in a.rules:
        if r == "capskip":
            rules[f"rule capskip b={a.budget:g}"] = _Recording(CAPSkip(budget=a.budget, sketch=a.sketch))
            if a.sketch != 0:
                rules[f"rule capskip b={a.budget:g} exact"] = _Recording(CAPSkip(budget=a.budget, sketch=0))
        elif r == "random":
            rules[f"rule random b={a.budget:g}"] = RandomSkip(match=CAPSkip(budget=a.budget, sketch=a.sketch))
        elif r in ("sb", "kabena", "ub"):
            rules[f"rule {r}"] = make_rule(r, **({"keep": 0.5, "start": 0.0, "end": 1.0} if r == "sb" else {}))
    for label, rule in rules.items():
        def run_rule(rule=rule):
            cm.rule = rule
            return step(cm)
        variants[label] = run_rule

    def observe(v):
        st = capskip_fx.stats(cm)
        return st.kept / st.n if v != "dense compiled" else 1.0, st.selection_ms if v.startswith("rule") else None
    times, kept, sel_ms, t_compile = interleave(variants, a.warmup, a.reps, observe)
    med = statistics.median
    F0, B0 = med([x[0] for x in times["dense compiled"]]), med([x[1] for x in times["dense compiled"]])
    rows = []
    for v in variants:
        fw, bw = med([x[0] for x in times[v]]), med([x[1] for x in times[v]])
        row = {"variant": v, "kept": med(kept[v]), "fwd_ms": fw * 1e3, "bwd_ms": bw * 1e3, "bwd_ratio": bw / B0,
               "step_ratio": (fw + bw) / (F0 + B0), "selection_ms": med(sel_ms[v]) if sel_ms[v][0] is not None else None}
        if v.startswith("capskip forced"):
            f = float(v.split("f=")[1])
            row["expected_max"] = f + 0.05
            row["ok"] = row["bwd_ratio"] <= f + 0.05
        rule = rules.get(v)
        if isinstance(rule, _Recording) and rule.view is not None:  # the selection alone, synchronised
            alone = []
            for _ in range(a.reps):
                sync(dev)
                t0 = time.perf_counter()
                rule.rule.select(rule.view)
                sync(dev)
                alone.append(time.perf_counter() - t0)
            row["selection_alone_ms"] = med(alone) * 1e3
            row["selection_of_step"] = med(alone) / (F0 + B0)
        rows.append(row)
    fmt = lambda v, p=2: "" if v is None else f"{v:.{p}f}"
    lines = ["| variant | kept | fwd ms | bwd ms | bwd/bwd_dense | expected <= | selection ms (stats) | "
             "selection alone ms | selection / dense step |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['kept']:.2f} | {r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} | {r['bwd_ratio']:.2f} | "
              f"{fmt(r.get('expected_max'))}{'' if 'ok' not in r else (' ok' if r['ok'] else ' OVER')} | "
              f"{fmt(r['selection_ms'])} | {fmt(r.get('selection_alone_ms'))} | "
              f"{fmt(None if 'selection_of_step' not in r else 100 * r['selection_of_step'], 1)}{'' if 'selection_of_step' not in r else ' %'} |"
              for r in rows]
    device = torch.cuda.get_device_name() if dev.startswith("cuda") else \
        f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    meta = {"device": device, "malloc_tuned": malloc_tuned, "torch": torch.__version__, "model": "gpt2 (transformers config)",
            "n_embd": a.lm_embd, "n_layer": a.lm_layers, "vocab": a.vocab, "seq_len": t, "batch_size": n, "amp": a.amp,
            "reps": a.reps, "warmup": a.warmup, "budget": a.budget, "sketch": a.sketch, "gather": a.gather,
            "warmup_s": t_compile, "command": "python " + " ".join(sys.argv)}
    table = "\n".join(lines)
    print(f"# causal LM (GPT-2 config, d={a.lm_embd}, {a.lm_layers} layers, vocab {a.vocab}), N={n} x T={t}, {a.amp}, "
          f"{device}; median of {a.reps} interleaved rounds, warm-up excluded ({t_compile:.0f} s)\n")
    print(table)
    stem = Path(a.out) if a.out else Path(__file__).parent / "results" / \
        f"{dev.split(':')[0]}_lm_gpt2_d{a.lm_embd}_l{a.lm_layers}_v{a.vocab}_n{n}_t{t}"
    write_results(stem, {"meta": meta, "rows": rows}, f"{json.dumps(meta)}\n\n{table}")


def vcas_setting(spec: str) -> tuple:
    rho, nu, *sampler = spec.split(",")
    return float(rho), float(nu), (sampler[0] if sampler else "systematic")


def vcas_label(setting: tuple) -> str:
    rho, nu, sampler = setting
    return f"vcas rho={rho:g} nu={nu:g}" + ("" if sampler == "systematic" else f" {sampler}")


def set_ratios(cm, rho: float, nu: float, sampler: str = "systematic") -> None:
    for r in cm.backend.state.runners:
        r.ctrl.rho = [rho] * len(r.ctrl.rho)
        r.ctrl.nu = [nu] * len(r.ctrl.nu)
        r.cfg = dataclasses.replace(r.cfg, sampler=sampler)


def vcas_flops(model, x, y, settings, a, amp) -> list[dict]:
    """Backward FLOPs of each VCAS setting as executed: the same passes on aot_eager (FX interpreter),
    so FlopCounterMode sees every aten matmul, the sampled ones included."""
    from torch.utils.flop_counter import FlopCounterMode

    cm = capskip_fx.compile(model, rule="vcas", backend="aot_eager", vcas=capskip_fx.VCAS(freq=10 ** 9))
    ctx = lambda: amp or torch.autocast(device_type="cpu", enabled=False)

    def count(draws):
        bw = 0
        for _ in range(draws):
            model.zero_grad(set_to_none=True)
            with ctx():  # the forward outside the counter: its module hooks would make Dynamo recompile
                loss = F.cross_entropy(cm(x), y)
            with FlopCounterMode(display=False) as fc:
                loss.backward()
            bw += fc.get_total_flops() + sum(r.wgrad_flops() for r in cm.backend.state.runners)
        return bw / draws

    with FlopCounterMode(display=False) as fc, torch.no_grad(), ctx():
        model(x)  # the eager forward: the same FLOPs as the compiled one
    fw0 = fc.get_total_flops()
    count(1)  # step 0 compiles and probes
    set_ratios(cm, 1.0, 1.0)
    bw0 = count(1)
    out = []
    for setting in settings:
        set_ratios(cm, *setting)
        bw = count(a.flop_draws)
        runner = cm.backend.state.runners[0]
        out.append({"variant": vcas_label(setting), "setting": setting, "bwd_gflop": bw / 1e9,
                    "bwd_flop_ratio": bw / bw0, "total_flop_ratio": (fw0 + bw) / (fw0 + bw0),
                    "vcas_accounting": runner.ctrl.flops_fraction(), "dense_bwd_gflop": bw0 / 1e9,
                    "fwd_gflop": fw0 / 1e9})
    return out


if __name__ == "__main__":
    main()

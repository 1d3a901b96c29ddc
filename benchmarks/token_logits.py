"""Token logits with the loss outside the model: what a CAPSkip step holds until its backward and how long it
takes when the head graph keeps the logits (saved for the selection and returned uncopied: the path of a rule that
reads them, SB or K-ABENA) or a (N, T, 1) stand-in (``Rule.reads_logits = False``: CAPSkip's own path), against
plain ``torch.compile``.  A tiny causal LM (embedding, tanh Linear, Linear head over V classes), HF's label
shift outside the model.  One process; the arms' compiled models built once, then steps interleaved round-robin,
medians, warm-up excluded.  Memory at the backward, by storage: "logits dropped" is what autograd holds for it
(saved_tensors_hooks), where the user's code drops the returned logits before backward() (Hugging Face's
Trainer); "logits held" adds the returned logits where they are not one of those saved tensors (a loop that
keeps ``z`` until backward()).  -> benchmarks/results/<stem>.{md,json}

    python benchmarks/token_logits.py [--n 8 --t 128 --vocab 8192 --budget 0.5 --backend inductor --threads 2]
"""
from __future__ import annotations

import argparse
import copy
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.cpu import retain_freed_memory
from capskip_fx.rules import CAPSkip
from results_io import write_results


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int = 64):
        super().__init__()
        self.emb, self.body, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.emb(ids))))


class CAPSkipKeepingLogits(CAPSkip):
    """CAPSkip on the path of a rule that reads the logits: the graph saves them (and returns them uncopied)."""

    reads_logits = True


def lm_loss(z, ids):
    labels = F.pad(ids, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(z.view(-1, z.shape[-1]), labels.reshape(-1), ignore_index=-100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--t", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    retain_freed_memory()
    torch.manual_seed(0)
    base = TinyLM(a.vocab)
    ids = torch.randint(0, a.vocab, (a.n, a.t), generator=torch.Generator().manual_seed(1))
    arms = {"plain torch.compile": torch.compile(copy.deepcopy(base), backend=a.backend),
            "capskip, logits kept": capskip_fx.compile(copy.deepcopy(base), rule=CAPSkipKeepingLogits(a.budget),
                                                       backend=a.backend, verify=False),
            "capskip, stand-in": capskip_fx.compile(copy.deepcopy(base), rule=CAPSkip(a.budget), backend=a.backend,
                                                    verify=False)}
    saved, held, times, kept = {k: 0 for k in arms}, {k: 0 for k in arms}, {k: [] for k in arms}, {}

    def step(name, m):
        storages = {}

        def pack(t):  # by storage: views of one tensor count once
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            return t

        m.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            z = m(ids)
        lm_loss(z, ids).backward()
        dt = time.perf_counter() - t0
        saved[name] = sum(storages.values())
        zs = z.untyped_storage()
        held[name] = saved[name] + (0 if zs.data_ptr() in storages else zs.nbytes())
        return dt

    for i in range(a.warmup + a.steps):
        for name, m in arms.items():
            dt = step(name, m)
            if i >= a.warmup:
                times[name].append(dt)
    for name, m in arms.items():
        if name != "plain torch.compile":
            st = capskip_fx.stats(m)
            kept[name] = (st.mode, st.kept, st.n)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    load = os.getloadavg()[0]
    logits_mb = a.n * a.t * a.vocab * 4 / 2**20
    cmd = "python benchmarks/" + pathlib.Path(sys.argv[0]).name + " " + " ".join(sys.argv[1:])
    md = [f"<!-- {cmd} -->",
          "# Token logits with the loss outside: kept or a stand-in",
          "",
          f"Tiny causal LM, N = {a.n}, T = {a.t}, V = {a.vocab} (one logits tensor: {logits_mb:.1f} MB), CAPSkip "
          f"b = {a.budget}, {a.backend}, {a.threads} thread(s), {a.steps} interleaved steps (after {a.warmup}), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load:.1f} when it ended.",
          "",
          "| arm | step (mode, kept / N) | held at the backward, logits dropped (MB) | ... logits held (MB) | "
          "step ms (median) | vs plain |",
          "|---|---|---|---|---|---|"]
    for name in arms:
        mode = kept.get(name, ("dense", a.n, a.n))
        md.append(f"| {name} | {mode[0]}, {mode[1]} / {mode[2]} | {saved[name] / 2**20:.1f} | {held[name] / 2**20:.1f} | "
                  f"{med[name]:.1f} | "
                  f"{med[name] / med['plain torch.compile']:.2f} |")
    print("\n".join(md))
    stem = pathlib.Path(a.out) if a.out else pathlib.Path(__file__).parent / "results" / (
        f"token_logits_n{a.n}_t{a.t}_v{a.vocab}_{a.backend}_t{a.threads}")
    write_results(stem, {"args": vars(a), "ms": times, "median": med, "saved_bytes": saved, "held_bytes": held, "kept": kept,
                         "load": load}, "\n".join(md))


if __name__ == "__main__":
    main()

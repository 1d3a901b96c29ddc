"""An in-model cross-entropy's backward, with the rule's dL/dz from that backward run on every row
(``loss_grad="prefix"``, the default) or derived from the forward (``"derived"``: the loss's backward then
runs on the kept rows only).  A tiny causal LM (embedding, tanh Linear, Linear head over V classes, HF's label
shift, ``ignore_index=-100``), CAPSkip, ``verify=False``; one process, the two settings interleaved round by
round (fresh compile each, warm-up steps excluded), the backward's median per round, then the median over
rounds.  -> benchmarks/results/<stem>.{md,json}

    python benchmarks/loss_grad.py [--n 16 --t 64 --vocab 4096 --budget 0.5 --backend inductor --threads 2]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from results_io import write_results


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int = 64):
        super().__init__()
        self.emb, self.body, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, ids, labels):
        z = self.head(torch.tanh(self.body(self.emb(ids))))
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        return F.cross_entropy(z.float().view(-1, z.shape[-1]), shifted.view(-1), ignore_index=-100), z


def backward_ms(setting: str, a, steps: int, warmup: int) -> tuple[float, int, int, int]:
    """(median backward ms, kept, n, rows the loss's backward last ran on)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cm = capskip_fx.compile(TinyLM(a.vocab), rule="capskip", budget=a.budget, backend=a.backend, verify=False,
                            loss_grad=setting)
    ids = torch.randint(0, a.vocab, (a.n, a.t))
    times = []
    for i in range(warmup + steps):
        loss, _ = cm(ids, ids)
        t0 = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - t0)
    st = capskip_fx.stats(cm)
    head = next(r for r in cm.backend.records if r.head)
    return statistics.median(times[warmup:]) * 1e3, st.kept, st.n, head.loss_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--t", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = {s: [] for s in ("prefix", "derived")}
    info = {}
    for _ in range(a.rounds):
        for s in rows:
            ms, kept, n, loss_rows = backward_ms(s, a, a.steps, a.warmup)
            rows[s].append(ms)
            info[s] = (kept, n, loss_rows)
    med = {s: statistics.median(v) for s, v in rows.items()}
    load = os.getloadavg()[0]
    cmd = "python benchmarks/" + pathlib.Path(sys.argv[0]).name + " " + " ".join(sys.argv[1:])
    md = [f"<!-- {cmd} -->",
          "# In-model cross-entropy: the rule's dL/dz from the loss's backward on every row, or derived",
          "",
          f"Tiny causal LM, N = {a.n}, T = {a.t}, V = {a.vocab}, CAPSkip b = {a.budget}, {a.backend}, "
          f"{a.threads} thread(s), {a.rounds} interleaved rounds × {a.steps} backwards (after {a.warmup}), "
          f"{time.strftime('%Y-%m-%d')}, load average {load:.1f} when it ended.",
          "",
          "| loss_grad | kept / N | loss backward on rows | backward ms (median) | per round | vs prefix |",
          "|---|---|---|---|---|---|"]
    for s in rows:
        kept, n, lr = info[s]
        md.append(f"| {s} | {kept} / {n} | {lr} | {med[s]:.1f} | {', '.join(f'{v:.1f}' for v in rows[s])} | "
                  f"{med[s] / med['prefix']:.2f} |")
    print("\n".join(md))
    stem = pathlib.Path(a.out) if a.out else pathlib.Path(__file__).parent / "results" / (
        f"loss_grad_lm_n{a.n}_t{a.t}_v{a.vocab}_{a.backend}_t{a.threads}")
    write_results(stem, {"args": vars(a), "ms": rows, "median": med, "info": info, "load": load}, "\n".join(md))


if __name__ == "__main__":
    main()

"""The one-line API on real data (scikit-learn's digits), seconds on a CPU.

    python examples/quickstart.py [--backend inductor|aot_eager] [--budget 0.3] [--epochs 3]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import capskip_fx


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="inductor")
    p.add_argument("--budget", type=float, default=0.3)
    p.add_argument("--epochs", type=int, default=3)
    a = p.parse_args()
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16
    y = torch.tensor(y)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
    model = capskip_fx.compile(model, budget=a.budget, backend=a.backend)  # the one added line
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for epoch in range(a.epochs):
        kept = ran = seen = 0
        for i in torch.randperm(len(x)).split(64):
            loss = F.cross_entropy(model(x[i]), y[i])
            loss.backward()  # runs on the kept rows only
            opt.step()
            opt.zero_grad()
            st = capskip_fx.stats(model)
            kept, ran, seen = kept + st.kept, ran + st.rows, seen + st.n
        with torch.no_grad():
            acc = (model(x).argmax(1) == y).float().mean().item()
        print(f"epoch {epoch}: loss {loss.item():.3f}  train acc {acc:.3f}  kept {kept}/{seen} rows ({kept / seen:.0%}), "
              f"backward ran on {ran} ({ran / seen:.0%}); last step bound ||S_k||/||G|| = {st.bound:.3f} <= b = {a.budget}")
    print(capskip_fx.report(model))


if __name__ == "__main__":
    main()

"""The backward proof where the backward regenerates randomness: attention with dropout.

CUDA's fused SDPA kernels (flash, memory-efficient, cuDNN) regenerate their dropout mask in the backward
from a philox seed and offset; at k gathered rows they would draw the masks of batch rows 0..k-1, so
passes/validate.py must refuse that backward (dense-masked, kind "random in the backward").  On the CPU the
math SDPA draws its mask in the forward and saves it: the backward is row-wise and runs on the kept rows.
Each case runs rule ``random`` (keep 0.5) with ``verify=False`` and compares the step's gradients with an
eager reference of the rule's weights: float64 without dropout; at dropout > 0 the same model compiled with
plain ``torch.compile`` on the same seed (the same masks: the fused kernel's philox state on CUDA, the eager
RNG on the CPU with ``fallback_random``), its loss weighted by the rule's weights.  Prints one JSON line; exit status 1
on a mismatch or a refusal that did not happen (or happened where it should not).

    python benchmarks/backward_proof_check.py [--device cuda] [--backend inductor|aot_eager]
"""
from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx


class Attn(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, p: float = 0.0):
        super().__init__()
        self.qkv, self.o, self.head, self.h, self.p = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, 5), heads, p

    def forward(self, x):  # (N, T, d)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.h, -1)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)
        return self.head((x + self.o(a.transpose(1, 2).flatten(2))).mean(1))


def run(device: str, backend: str, p: float, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model = Attn(p=p).to(device, dtype)
    plain = torch.compile(copy.deepcopy(model), backend="inductor" if backend == "inductor" else "aot_eager")
    cm = capskip_fx.compile(model, rule="random", keep=0.5, backend=backend, verify=False)
    x = torch.randn(16, 8, 32, device=device, dtype=dtype)
    y = torch.randint(0, 5, (16,), device=device)
    errs, st = [], None
    for step in range(2):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        F.cross_entropy(cm(x), y).backward()
        st = capskip_fx.stats(cm)
        got = [q.grad.double() for q in model.parameters()]
        if p == 0:  # float64 eager reference of the rule's weights
            ref = copy.deepcopy(model).double()
            loss = (F.cross_entropy(ref(x.double()), y, reduction="none") * st.weight.double()).sum() / x.shape[0]
            want = torch.autograd.grad(loss, list(ref.parameters()))
        else:  # plain torch.compile of the same model on the same seed: the same dropout masks
            torch.manual_seed(100 + step)
            loss = (F.cross_entropy(plain(x), y, reduction="none") * st.weight).sum() / x.shape[0]
            want = torch.autograd.grad(loss, list(plain.parameters()))
        errs.append(max(float((g - w.double()).norm() / w.double().norm().clamp_min(1e-30)) for g, w in zip(got, want)))
    fb = st.fallback
    return {"device": device, "backend": backend, "dropout_p": p, "dtype": str(dtype), "mode": st.mode,
            "kept": st.kept, "n": st.n, "fallback_kind": fb.kind.value if fb else None, "max_rel_err": max(errs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="inductor")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    torch._inductor.config.fallback_random = not cuda  # CPU: eager RNG in both compiled models
    dtype = torch.float32
    results, ok = [], True
    for p in (0.0, 0.1):
        r = run(a.device, a.backend, p, dtype)
        # CUDA: the fused kernels regenerate dropout in the backward (refused); CPU: the mask is saved (selected)
        expect_refused = cuda and p > 0
        r["expected"] = "refused (random in the backward)" if expect_refused else "selected"
        refused = r["mode"] != "selected" and r["fallback_kind"] == "random in the backward"
        tol = 1e-4 if p == 0 else 1e-3
        r["ok"] = (refused if expect_refused else r["mode"] == "selected") and r["max_rel_err"] < tol
        ok &= r["ok"]
        results.append(r)
    print(json.dumps({"check": "backward_proof", "results": results, "ok": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

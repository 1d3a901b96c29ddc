"""Tiny models and gradient helpers that several test files share (each file used to define its own copy).

A model class shared across files shares its ``forward`` code object: conftest's autouse ``many_compiles``
raises Dynamo's per-code recompile_limit, and each compiled model is its own cache entry, so tests stay
independent of which ran before them."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Linear -> GELU (-> Dropout) -> Linear head: the plain classifier most tests compile.
    ``p_drop=None``: no Dropout module at all (0.0: a Dropout that drops nothing)."""

    def __init__(self, d: int = 6, hidden: int = 8, classes: int = 3, p_drop=None):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.drop = nn.Identity() if p_drop is None else nn.Dropout(p_drop)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.drop(F.gelu(self.fc(x))))


class GraphBreak(nn.Module):
    """Two Dynamo graphs: Linear + ReLU, a graph break, then Linear + ReLU + head (a body graph, then the
    head graph)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        x = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.head(self.b(x).relu())


class Block(nn.Module):
    """A pre-norm residual block on (N, T, D) tokens: the unit regional compile compiles."""

    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x)).relu()


class Tokens(nn.Module):
    """Embedding, two pre-norm blocks on (N, T, D) tokens, mean pool, Linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(8) for _ in range(2)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean(1))


def grads(model: nn.Module, dtype=None) -> dict:
    """{name: detached copy of its gradient} for every parameter (zeros where it has none), in ``dtype``
    if given."""
    out = {}
    for k, p in model.named_parameters():
        g = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
        out[k] = (g if dtype is None else g.to(dtype)).clone()
    return out

"""Property-based fuzzer of capskip's one promise.

    Every training step's parameter gradients are EXACTLY the rule's ``sum_i w_i * grad(l_i) / N``
    (w = the weights the rule returned for that forward's rows, l_i the per-example loss), or the
    step runs plain dense (w = all ones) with a warning and a recorded reason
    (``capskip_fx.stats(cm).fallback`` or a non-None ``reason`` in ``capskip_fx.report(cm)``).
    Never anything else, never a crash.

How the fuzzer works
--------------------
* A grammar of small random models (:class:`Spec`).  Each spec is turned into Python source for the
  model's ``forward`` (printed with every falsifying example) and exec'd into a fresh class, so every
  model has its own code object: Dynamo's per-code cache limits never interact across examples, and a
  falsifying example is a readable, copy-pasteable model.
* A recording rule (:class:`RecordingRule`) returns a drawn keep set with random positive weights
  (k = 0, k = N and everything between, in any order across steps) and records ``(view.z, weight)``
  per call.  Each call is matched to the forward whose returned logits equal ``view.z``; stats() is
  not used for that.
* The oracle (:func:`check_backward`) is a float64 EAGER reference on a deep copy of the model:
  per forward f, ``sum_i w_fi * CE_i / N_f`` with w_f = the rule's weights for f, or all ones if a
  fallback reason is recorded.  Gradients are linear in w, so every allowed combination is a sum
  of per-(forward, candidate) reference gradients.  Every ``loss.backward()`` of a step is checked
  on its own (the increment of ``.grad`` it produced, and the rule calls made during it).
* Dropout: ``nn.Dropout(p)`` with p in {0.25, 0.5} in train mode.  The same masks in the compiled
  model and the reference come from seeding: ``torch.manual_seed(seed_f)`` before each forward in
  both, and ``torch._inductor.config.fallback_random = True`` (set by this file's autouse fixture;
  capskip's backends go through Inductor's ``compile_fx``, whose random-op replacement would otherwise
  draw from its own seeds, also on aot_eager: the masks then differ, rel. errors ~0.6).  The dropout
  mask is drawn on a contiguous ``ones_like`` and multiplied in (``h * drop(ones)``, the same thing as
  ``drop(h)``): a mask follows its input's strides, and after e.g. a transposed BatchNorm the compiled
  graph's strides differ from eager's (same values, another mask).  The
  reference asserts its logits equal the compiled model's, which guards all this (and any forward bug).

* Diagnosis: a failure message says which weights the library applied when that has a simple answer
  (e.g. "forward 0 got mask(call0)": another forward's keep mask), from ones / zeros / every rule
  call's weights and 0-1 masks.  ``--hypothesis-show-statistics`` shows how often forwards really ran
  selected vs dense (and why).

Tests
-----
* ``test_fuzz_*`` (default tier, derandomised so CI is stable; ~70 s of tests, ~85 s wall on 2 cores):
  fresh-compile tests draw an architecture per example (rowwise / side_inputs / graph_breaks /
  row_mixing / layout; ~1-2 s each on aot_eager, so few examples); pooled tests (multi_forward /
  keep_sequences) share three row-wise models compiled once and draw batches, keep sets and
  forward/backward patterns (cheap, most of the ~250 examples).
* ``test_slow_fuzz_*`` (``--runslow``): ~3000 random examples (about an hour on 2 cores), incl.
  Inductor float32 (tolerance 1e-4, or 10x eager float32's own error when that is larger).
* ``test_harness_*``: the reference, the matching and the oracle on a plain row-wise model (must pass).
* ``test_regression_*``: deterministic repros of known bugs.
Environment: ``CAPSKIP_FUZZ_SCALE=x`` multiplies every example count (0.1 for a quick look, 10 for a
soak); ``CAPSKIP_FUZZ_SHRINK=0`` reports failures unshrunk (a failing fresh-compile test otherwise
spends up to Hypothesis's 5 minutes shrinking: every shrink step compiles a model).
"""
from __future__ import annotations

import copy
import itertools
import linecache
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch._inductor.config
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import strategies as st

import capskip_fx
from capskip_fx.rules import Forced, Rule, Selection

from helpers.examples import derandomize, examples
from helpers.models import MLP, grads

pytestmark = pytest.mark.heavy  # out of the fast tier (pyproject.toml markers)

TOL = {torch.float64: 1e-8, torch.float32: 1e-4}

# ----------------------------------------------------------------------------------------------
# Dynamo: many small models are compiled in one process.  Every model has its own code object
# (see build_model), but keep the global limits out of the way too.


@pytest.fixture(autouse=True)
def _dynamo_limits():
    cfg = torch._dynamo.config
    patch = {k: 10**6 for k in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                                "accumulated_cache_size_limit") if hasattr(cfg, k)}
    threads = torch.get_num_threads()
    # tiny tensors: one intra-op thread (two threads on 2 shared cores made every eager op ~40x slower)
    torch.set_num_threads(1)
    try:
        with cfg.patch(**patch), torch._inductor.config.patch(fallback_random=True), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="capskip_fx")  # the library's fallback warnings
            yield
    finally:
        torch.set_num_threads(threads)


def _settings(n, **kw):
    n = max(1, round(n * float(os.environ.get("CAPSKIP_FUZZ_SCALE", "1"))))  # e.g. 0.1 for a quick look, 10 for a soak
    if os.environ.get("CAPSKIP_FUZZ_SHRINK", "1") == "0":  # quick iteration: report the first failure unshrunk
        kw["phases"] = [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(max_examples=n, deadline=None, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck), **kw)


def fast(n):
    """Default tier: ``n`` examples under HYPOTHESIS_PROFILE=thorough (a fresh draw), a share of them
    under ci (the default; derandomised: the same examples every CI run).  helpers/examples.py."""
    return _settings(examples(n), derandomize=derandomize())


def slow(n):
    return _settings(n)


# ----------------------------------------------------------------------------------------------
# The model grammar

ROWWISE = ("linear", "flat_linear", "reshape_linear", "ln", "gelu", "relu", "relu_inplace", "res_mlp", "glu",
           "attn", "einsum_attn", "tokmix", "conv1d", "groupnorm", "bn_eval", "l2norm", "dropout", "droppath",
           "row_mask", "fn_rowwise")
# cross-example ops (true coupling; "center_detached" mixes the forward only) and row-wise math whose
# batch is not batch-major inside (layout)
MIXING = ("bn", "center", "center_detached", "bsoftmax", "bsum", "max0", "normalize0", "roll", "flip", "shift_cat",
          "sort", "cumsum", "index_select", "perm_index", "gram", "mha_over_batch",
          "rolled_mask", "row_index_value", "fn_mixing")
# row-wise forwards whose backward is not (passes/validate.py refuses them): a parameter indexed by the row
# index, a parameter gathered with per-row indices, a random mask beside a token-major value
BACKWARD = ("row_param", "gather_param", "tokmajor_mask")
LAYOUT = ("tokmajor", "mha_bf", "mha_tf")
NMAX = 9  # batch sizes 2..9


@dataclass(frozen=True)
class Spec:
    inp: str  # "float": x (N, T, din); "float2d": x (N, din) -> tokens; "embed": x (N, T) int -> nn.Embedding
    din: int
    T: int
    D: int
    C: int
    heads: int
    blocks: tuple  # tuple of tuples of op names
    breaks: tuple  # graph break after block i
    pool: str  # "mean" | "first" | "flat"
    pos: bool = False  # forward(x, pos) with pos (T, D) added to the tokens
    mask_kw: bool = False  # forward(x, mask=m) with m (N, T), multiplied into the tokens
    cls: bool = False  # a learned CLS token concatenated in front (expand + cat): T + 1 tokens
    p: float = 0.25  # dropout / drop-path rate
    seed: int = 0
    # after the head, past a graph break: "" nothing; "one" z * 1.0 (weights pass on: selects); "param" z times a
    # learnable scale, "param_eager" the same in eager code (its gradient bypasses the rows: dense, reason)
    after_head: str = ""


VOCAB = 11


def codegen(spec: Spec):
    """Python source of ``forward`` and the submodules, buffers, parameters and eval-mode modules it uses."""
    T, D, H = spec.T, spec.D, spec.heads
    mods: dict = {}
    bufs: dict = {}
    params: dict = {}
    evals: list = []
    sig = "self, x" + (", pos" if spec.pos else "") + (", mask=None" if spec.mask_kw else "")
    L = [f"def forward({sig}):"]
    if spec.inp == "embed":
        mods["inp"] = lambda: nn.Embedding(VOCAB, D)
        L.append("    h = self.inp(x)")
    elif spec.inp == "float2d":
        mods["inp"] = lambda T=T: nn.Linear(spec.din, T * D)  # (T bound now: a CLS token changes it below)
        L.append(f"    h = self.inp(x).unflatten(1, ({T}, {D}))")
    else:
        mods["inp"] = lambda: nn.Linear(spec.din, D)
        L.append("    h = self.inp(x)")
    if spec.pos:
        L.append("    h = h + pos")
    if spec.mask_kw:
        L.append("    h = h * mask.unsqueeze(-1)")
    if spec.cls:
        params["cls"] = (1, 1, D)
        L.append(f"    h = torch.cat([self.cls.expand(h.shape[0], 1, {D}), h], 1)")
        T = T + 1
    for b, block in enumerate(spec.blocks):
        for j, op in enumerate(block):
            m = f"b{b}_{j}"
            if op == "linear":
                mods[m] = lambda: nn.Linear(D, D)
                L.append(f"    h = self.{m}(h)")
            elif op == "flat_linear":  # (N, T, D) -> (N*T, D) batch-major -> back
                mods[m] = lambda: nn.Linear(D, D)
                L.append(f"    h = self.{m}(h.flatten(0, 1)).unflatten(0, (h.shape[0], {T}))")
            elif op == "reshape_linear":  # reshape(-1, D) / view with the SymInt batch
                mods[m] = lambda: nn.Linear(D, D)
                L.append(f"    h = self.{m}(h.reshape(-1, {D})).view(h.shape[0], {T}, {D})")
            elif op == "relu_inplace":
                mods[m] = lambda: nn.Linear(D, D)
                L.append(f"    h = F.relu(self.{m}(h), inplace=True)")
            elif op == "glu":  # chunk of the features
                mods[m] = lambda: nn.Linear(D, 2 * D)
                L.append(f"    a, b = self.{m}(h).chunk(2, dim=-1)")
                L.append("    h = a * torch.sigmoid(b)")
            elif op == "einsum_attn":  # token attention written with einsum (bmm)
                mods[m + "q"] = lambda: nn.Linear(D, D)
                mods[m + "k"] = lambda: nn.Linear(D, D)
                L.append(f"    att = torch.softmax(torch.einsum('ntd,nsd->nts', self.{m}q(h), self.{m}k(h)) * {D ** -0.5}, dim=-1)")
                L.append("    h = h + torch.einsum('nts,nsd->ntd', att, h)")
            elif op == "conv1d":  # over the tokens, (N, D, T)
                mods[m] = lambda: nn.Conv1d(D, D, 3, padding=1)
                L.append(f"    h = self.{m}(h.transpose(1, 2)).transpose(1, 2)")
            elif op == "groupnorm":  # per example over (D, T)
                mods[m] = lambda: nn.GroupNorm(1, D)
                L.append(f"    h = self.{m}(h.transpose(1, 2)).transpose(1, 2)")
            elif op == "bn_eval":  # BatchNorm1d in eval mode: row-wise (running statistics)
                mods[m] = lambda: nn.BatchNorm1d(D)
                evals.append(m)
                L.append(f"    h = self.{m}(h.transpose(1, 2)).transpose(1, 2)")
            elif op == "l2norm":  # a reduction over features, per row
                L.append("    h = h / h.norm(dim=-1, keepdim=True).clamp_min(1e-3)")
            elif op == "ln":
                mods[m] = lambda: nn.LayerNorm(D)
                L.append(f"    h = self.{m}(h)")
            elif op == "gelu":
                L.append("    h = F.gelu(h)")
            elif op == "relu":
                L.append("    h = F.relu(h)")
            elif op == "res_mlp":
                mods[m + "a"] = lambda: nn.Linear(D, 2 * D)
                mods[m + "b"] = lambda: nn.Linear(2 * D, D)
                L.append(f"    h = h + self.{m}b(F.gelu(self.{m}a(h)))")
            elif op == "attn":  # token attention through SDPA on (N, H, T, d)
                mods[m + "qkv"] = lambda: nn.Linear(D, 3 * D)
                mods[m + "o"] = lambda: nn.Linear(D, D)
                L.append(f"    qkv = self.{m}qkv(h).unflatten(-1, (3, {H}, {D // H})).permute(2, 0, 3, 1, 4)")
                L.append("    a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])")
                L.append(f"    h = h + self.{m}o(a.transpose(1, 2).flatten(2))")
            elif op == "tokmix":  # permute keeping the batch first, Linear over tokens
                mods[m] = lambda T=T: nn.Linear(T, T)
                L.append(f"    h = h + self.{m}(h.permute(0, 2, 1)).permute(0, 2, 1)")
            elif op == "dropout":  # nn.Dropout(p > 0) in train mode; the reference re-seeds (module docstring)
                mods[m] = lambda: nn.Dropout(spec.p)
                L.append(f"    h = h * self.{m}(torch.ones_like(h, dtype=torch.float32, memory_format=torch.contiguous_format)).to(h.dtype)")
            elif op == "droppath":  # per-row scaling by a fixed per-row tensor
                bufs[m] = ("droppath", NMAX)
                L.append(f"    h = h * self.{m}[:h.shape[0]].view(-1, 1, 1)")
            elif op == "row_mask":  # HF's padding mask: mask[arange(N)[:, None], arange(T)[None, :]]
                # the threshold off zero: with the fuzz models' zero-initialised norm biases a masked token's
                # normalised features are 0 up to rounding, and "> 0" sat on a tie that any other order of the
                # norm's sums flips (gradients O(1) apart, logits 1e-16: found by the slow tier)
                L.append("    mk = h[..., 0] > 0.1")
                L.append(f"    h = h * mk[torch.arange(h.shape[0], device=h.device)[:, None], "
                         f"torch.arange({T}, device=h.device)[None, :]].unsqueeze(-1).to(h.dtype)")
            # -- cross-example ops
            elif op == "rolled_mask":  # the same with the row index rolled: row b reads row b + 1's mask
                L.append("    mk = h[..., 0] > 0.1")
                L.append(f"    h = h * mk[(torch.arange(h.shape[0], device=h.device)[:, None] + 1) % h.shape[0], "
                         f"torch.arange({T}, device=h.device)[None, :]].unsqueeze(-1).to(h.dtype)")
            elif op == "bn":
                mods[m] = lambda: nn.BatchNorm1d(D)
                L.append(f"    h = self.{m}(h.transpose(1, 2)).transpose(1, 2)")
            elif op == "center":
                L.append("    h = h - h.mean(0)")
            elif op == "center_detached":  # mixes the forward values only (no gradient through the mean)
                L.append("    h = h - h.mean(0).detach()")
            elif op == "max0":
                L.append("    h = h + h.amax(0)")
            elif op == "normalize0":
                L.append("    h = F.normalize(h, dim=0)")
            elif op == "flip":
                L.append("    h = h + h.flip(0)")
            elif op == "shift_cat":  # slicing + concatenating along the batch
                L.append("    h = h + torch.cat([h[1:], h[:1]], 0)")
            elif op == "perm_index":  # advanced indexing of the batch
                L.append("    h = h + h[torch.arange(h.shape[0] - 1, -1, -1, device=h.device)]")
            elif op == "bsoftmax":
                L.append("    h = h * torch.softmax(h, dim=0)")
            elif op == "bsum":
                L.append("    h = h + h.sum(0) * 0.25")
            elif op == "roll":
                L.append("    h = h + torch.roll(h, 1, 0)")
            elif op == "row_index_value":  # the row index in arithmetic: a gathered backward would renumber it
                L.append("    h = h * (1 + 0.05 * torch.arange(h.shape[0], dtype=h.dtype, device=h.device)[:, None, None])")
            elif op == "row_param":  # a learned vector per batch position: param[arange(N)]
                params[m] = (NMAX, D)
                L.append(f"    h = h + self.{m}[torch.arange(h.shape[0], device=h.device)].unsqueeze(1)")
            elif op == "gather_param":  # row b reads parameter row b at its own columns
                params[m] = (NMAX, D)
                L.append(f"    gi = (h[:, 0, :2].detach().abs() * 3).long().clamp(max={D - 1})")
                L.append(f"    h = h + torch.gather(self.{m}, 1, gi).sum(1).view(-1, 1, 1)")
            elif op == "tokmajor_mask":  # i.i.d. mask drawn for a token-major (T*N, D) value
                L.append(f"    t = h.transpose(0, 1).reshape(-1, {D})")
                L.append("    t = t * (torch.rand(t.shape, dtype=torch.float32) > 0.5).to(t.dtype)")
                L.append(f"    h = t.reshape({T}, -1, {D}).transpose(0, 1)")
            elif op == "fn_mixing":  # a custom autograd.Function whose backward mixes rows (not declared)
                L.append("    h = CenterGrad.apply(h)")
            elif op == "fn_rowwise":  # a custom autograd.Function declared row-wise (capskip_fx.rowwise)
                L.append("    h = ScaleGrad.apply(h)")
            elif op == "sort":
                L.append("    h = h + torch.sort(h, dim=0).values")
            elif op == "cumsum":
                L.append("    h = h + h.cumsum(0) * 0.25")
            elif op == "index_select":
                L.append("    h = h + h.index_select(0, torch.arange(h.shape[0] - 1, -1, -1, device=h.device))")
            elif op == "gram":  # an (N, N) Gram mixed back into h
                L.append("    f = h.flatten(1)")
                L.append("    h = h + (torch.softmax(f @ f.T, dim=-1) @ f).view_as(h)")
            elif op == "mha_over_batch":  # batch_first=False fed (N, T, D): attends over the batch
                mods[m] = lambda: nn.MultiheadAttention(D, H, batch_first=False)
                L.append(f"    h = h + self.{m}(h, h, h, need_weights=False)[0]")
            # -- row-wise math, batch not batch-major inside
            elif op == "tokmajor":  # token-major flattening (T*N, D) into a Linear, reshaped back
                mods[m] = lambda: nn.Linear(D, D)
                L.append(f"    h = self.{m}(h.transpose(0, 1).reshape(-1, {D})).reshape({T}, -1, {D}).transpose(0, 1)")
            elif op == "mha_bf":
                mods[m] = lambda: nn.MultiheadAttention(D, H, batch_first=True)
                L.append(f"    h = h + self.{m}(h, h, h, need_weights=False)[0]")
            elif op == "mha_tf":  # batch_first=False used correctly: (T, N, D)
                mods[m] = lambda: nn.MultiheadAttention(D, H, batch_first=False)
                L.append("    t = h.transpose(0, 1)")
                L.append(f"    h = h + self.{m}(t, t, t, need_weights=False)[0].transpose(0, 1)")
            else:
                raise AssertionError(op)
        if spec.breaks[b]:
            L.append("    torch._dynamo.graph_break()")
    if spec.pool == "mean":
        L.append("    h = h.mean(1)")
        mods["head"] = lambda: nn.Linear(D, spec.C)
    elif spec.pool == "first":
        L.append("    h = h[:, 0]")
        mods["head"] = lambda: nn.Linear(D, spec.C)
    else:
        L.append("    h = h.flatten(1)")
        mods["head"] = lambda T=T: nn.Linear(T * D, spec.C)
    if not spec.after_head:
        L.append("    return self.head(h)")
    else:
        L.append("    z = self.head(h)")
        if spec.after_head == "param_eager":
            L.append("    return scale_eagerly(z, self.logit_scale)")
        else:
            L.append("    torch._dynamo.graph_break()")
            L.append("    return z * 1.0" if spec.after_head == "one" else "    return z * self.logit_scale")
        if spec.after_head != "one":
            params["logit_scale"] = ()
    return "\n".join(L) + "\n", mods, bufs, params, evals


@torch._dynamo.disable
def scale_eagerly(z, s):
    return z * s


class CenterGrad(torch.autograd.Function):
    """Identity forward; the backward centres the gradient over the batch (mixes rows the proof can't see)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0, keepdim=True)


@capskip_fx.rowwise
class ScaleGrad(torch.autograd.Function):
    """x -> 2x with its own (row-wise) backward."""

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class FuzzNet(nn.Module):
    src = ""

    def __repr__(self):
        return f"{type(self).__name__}(\n{self.src})"


_UID = itertools.count()


def build_model(spec: Spec, dtype=torch.float64) -> nn.Module:
    """A fresh class (own code object for Dynamo) whose forward is the generated source."""
    src, mods, bufs, params, evals = codegen(spec)
    uid = next(_UID)
    fname = f"<capskip-fuzz-model-{uid}>"
    linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)  # tracebacks / stack traces
    ns = {"torch": torch, "F": F, "CenterGrad": CenterGrad, "ScaleGrad": ScaleGrad, "scale_eagerly": scale_eagerly}
    exec(compile(src, fname, "exec"), ns)
    cls = type(f"FuzzNet{uid}", (FuzzNet,), {"forward": ns["forward"], "src": src})
    torch.manual_seed(spec.seed)
    model = cls()
    for name, make in mods.items():
        model.add_module(name, make())
    for name, (kind, n) in bufs.items():
        keep = torch.rand(n) >= spec.p
        model.register_buffer(name, keep.to(torch.float64) / (1 - spec.p))
    for name, shape in params.items():
        model.register_parameter(name, nn.Parameter(0.5 * torch.randn(shape)))
    model = model.to(dtype).train()
    for name in evals:
        bn = getattr(model, name)
        with torch.no_grad():
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
        bn.eval()
    return model


# ----------------------------------------------------------------------------------------------
# Spec strategies

@st.composite
def specs(draw, ops=ROWWISE, extra=(), pos=False, mask_kw=False, breaks=False, max_depth=3, after_head=False):
    """A random model.  ``extra``: ops of which exactly one is inserted somewhere (row mixing / layout).
    ``pos``/``mask_kw``/``breaks``: False (never), True (always) or None (drawn)."""
    T = draw(st.integers(1, 4))
    D = draw(st.integers(3, 8))
    C = draw(st.integers(2, 5))
    heads = draw(st.sampled_from([h for h in (1, 2, 3, 4) if D % h == 0]))
    inp = draw(st.sampled_from(["float", "float2d", "embed"]))
    depth = draw(st.integers(1, max_depth))
    blocks = [draw(st.lists(st.sampled_from(ops), min_size=1, max_size=3)) for _ in range(depth)]
    if extra:
        op = draw(st.sampled_from(extra))
        b = draw(st.integers(0, depth - 1))
        blocks[b].insert(draw(st.integers(0, len(blocks[b]))), op)
    br = [draw(st.booleans()) if breaks is None else bool(breaks) for _ in range(depth)]
    if breaks is True:  # at least one break (after the last block: right before the pooling and head)
        br[draw(st.integers(0, depth - 1))] = True
    return Spec(inp=inp, din=draw(st.integers(3, 8)), T=T, D=D, C=C, heads=heads,
                blocks=tuple(tuple(b) for b in blocks), breaks=tuple(br),
                pool=draw(st.sampled_from(["mean", "first", "flat"])),
                pos=draw(st.booleans()) if pos is None else pos,
                mask_kw=draw(st.booleans()) if mask_kw is None else mask_kw,
                cls=draw(st.booleans()),
                p=draw(st.sampled_from([0.25, 0.5])), seed=draw(st.integers(0, 2**16)),
                after_head=draw(st.sampled_from(["", "one", "param", "param_eager"])) if after_head else "")


# keep plans: one per rule call, cycled.  (kind, weighted, seed)
KINDS = ("none", "all", "some", "some", "one", "prefix")
plans = st.lists(st.tuples(st.sampled_from(KINDS), st.booleans(), st.integers(0, 2**16)), min_size=1, max_size=4)
OPTIONS = st.sampled_from([{}, {}, {"granule": 2}, {"gather_below": 1.0}, {"granule": 4, "gather_below": 1.0},
                           {"min_rows": 1}, {"gather": "graph"}, {"gather": "graph", "granule": 2}])


# ----------------------------------------------------------------------------------------------
# The recording rule

class RecordingRule(Rule):
    """Keeps a drawn set with random positive weights; records (z, weight) per call."""

    name = "fuzz"
    needs_labels = False  # reads nothing but n

    def __init__(self, plan):
        self.plan = list(plan)
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.count = 0

    def select(self, view):
        n = view.n
        kind, weighted, seed = self.plan[self.count % len(self.plan)]
        self.count += 1
        g = torch.Generator().manual_seed(seed)
        w = torch.zeros(n, dtype=torch.float64)
        if kind == "all":
            keep = torch.arange(n)
        elif kind == "one":
            keep = torch.randint(0, n, (1,), generator=g)
        elif kind == "some":
            k = int(torch.randint(1, max(n, 2), (1,), generator=g))
            keep = torch.randperm(n, generator=g)[:k]
        elif kind == "prefix":  # the first k rows: a gather that ignores the kept indices can't be seen
            keep = torch.arange(int(torch.randint(1, max(n, 2), (1,), generator=g)))
        else:
            keep = torch.zeros(0, dtype=torch.long)
        w[keep] = torch.empty(len(keep), dtype=torch.float64).uniform_(0.25, 2.0, generator=g) if weighted else 1.0
        w = w.to(device=view.delta.device, dtype=view.delta.dtype)
        self.calls.append((view.z.detach().clone(), w.clone()))
        return Selection(weight=w)

    def __repr__(self):
        return f"RecordingRule({self.plan})"


# ----------------------------------------------------------------------------------------------
# Forwards, steps and the oracle

@dataclass
class Fwd:
    args: tuple
    kwargs: dict
    y: torch.Tensor
    seed: int
    used: bool = True  # False: a forward that is never back-propagated
    nograd: bool = False  # (unused forwards) under torch.no_grad(), e.g. a metrics forward

    @property
    def n(self) -> int:
        return self.y.shape[0]


def make_forward(spec: Spec, n: int, seed: int, dtype=torch.float64, used=True, nograd=False) -> Fwd:
    g = torch.Generator().manual_seed(seed)
    if spec.inp == "embed":
        x = torch.randint(0, VOCAB, (n, spec.T), generator=g)
    elif spec.inp == "float2d":
        x = torch.randn(n, spec.din, generator=g, dtype=dtype)
    else:
        x = torch.randn(n, spec.T, spec.din, generator=g, dtype=dtype)
    args = (x,)
    if spec.pos:
        args += (0.5 * torch.randn(spec.T, spec.D, generator=g, dtype=dtype),)
    kwargs = {}
    if spec.mask_kw:
        kwargs["mask"] = torch.where(torch.rand(n, spec.T, generator=g) < 0.25, 0.0, 1.0).to(dtype) \
            * torch.empty(n, spec.T, dtype=dtype).uniform_(0.5, 1.5, generator=g)
    y = torch.randint(0, spec.C, (n,), generator=g)
    return Fwd(args, kwargs, y, seed=seed + 7919, used=used, nograd=nograd and not used)


def _as64(v):
    return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def _grads(model) -> dict:
    return grads(model, torch.float64)


def reason_recorded(cm) -> Optional[str]:
    cm = cm.compiled if isinstance(cm, InPlace) else cm
    st_ = capskip_fx.stats(cm)
    if st_.fallback is not None:
        return st_.fallback
    if st_.mode == "dense" and st_.note:  # dense by design, said so (the string backend's static first batch)
        return st_.note
    return next((r["reason"] for r in capskip_fx.report(cm) if r.get("reason")), None)


class InPlace:
    """A model compiled in place (``m.compile()``, per layer, per block) as the fuzzer's compiled model:
    called like it, with the recording rule its string backend was given."""

    def __init__(self, compiled: nn.Module, rule: "RecordingRule"):
        self.compiled, self.rule = compiled, rule

    def __call__(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)


IDIOMS = ("in_place", "per_layer", "per_child")


def compile_idiom(model: nn.Module, plan, idiom: str, backend: str = "aot_eager") -> InPlace:
    """Compile ``model`` in place with the string backend: the whole model, every leaf module with
    parameters (per layer), or every direct child (per block)."""
    rule = RecordingRule(plan)
    opts = {"rule": rule, "backend": backend, "verify": False}
    if idiom == "in_place":
        targets = [model]
    elif idiom == "per_layer":
        targets = [m for m in model.modules() if not list(m.children()) and any(True for _ in m.parameters(False))]
    else:
        targets = [m for m in model.children() if any(True for _ in m.parameters())]
    for m in targets:
        m.compile(backend="capskip", options=opts)
    return InPlace(model, rule)


def max_rel_err(got: dict, ref: dict) -> tuple[float, str]:
    """max over parameters of ||g - r|| / ||r||, with a floor of 1e-4 * the total norm for ~zero grads: a
    gradient that is zero in exact arithmetic (a bias whose effect a LayerNorm removes) is float64
    rounding noise on both sides, ~1e-14 of the total (the soak found 4.9e-15 against a total of 0.27);
    with tolerance 1e-8 the floor still flags any error above 1e-12 of the total, far below what a
    wrong row or weight makes."""
    total = sum(float(r.pow(2).sum()) for r in ref.values()) ** 0.5
    worst, name = 0.0, ""
    for k, r in ref.items():
        diff = float((got[k] - r).norm())
        denom = max(float(r.norm()), 1e-4 * total, 1e-12)
        e = diff / denom
        if e > worst:
            worst, name = e, k
    return worst, name


def _eager_copy(model: nn.Module) -> nn.Module:
    """A deep copy that runs eagerly.  ``m.compile()`` stores a compiled bound method of the ORIGINAL module
    (``_compiled_call_impl``), which deepcopy shares: the copy would run the original's parameters."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        m._compiled_call_impl = None
    return ref


class Reference:
    """Float64 eager reference on a deep copy of the model taken before the step.  For a float32 model
    also an eager copy in its own dtype (``low``): how far eager float32 itself is from float64 sets the
    tolerance of ill-conditioned steps (e.g. BatchNorm over 2 rows)."""

    def __init__(self, model: nn.Module):
        self.model = _eager_copy(model).double()
        low = next(model.parameters()).dtype != torch.float64
        self.low = _eager_copy(model) if low else None
        self.cache: dict = {}

    def grad(self, fwd: Fwd, w: torch.Tensor, key, low: bool = False) -> tuple[dict, torch.Tensor]:
        key = (key, "low") if low else key
        if key not in self.cache:
            m = self.low if low else self.model
            cast = (lambda v: v) if low else _as64
            m.zero_grad(set_to_none=True)
            torch.manual_seed(fwd.seed)
            z = m(*map(cast, fwd.args), **{k: cast(v) for k, v in fwd.kwargs.items()})
            losses = F.cross_entropy(z, fwd.y, reduction="none")
            (losses * w.to(losses.dtype)).sum().div(fwd.n).backward()
            self.cache[key] = (_grads(m), z.detach().double())
        return self.cache[key]


def _same(z: torch.Tensor, logits: torch.Tensor) -> bool:
    if z.shape != logits.shape:
        return False
    zz, ll = z.double(), logits.detach().double()
    return torch.equal(zz, ll) or torch.allclose(zz, ll, rtol=1e-12, atol=1e-14)


def _event(msg: str) -> None:
    try:
        event(msg)
    except Exception:  # outside a Hypothesis test (the plain regression tests)
        pass


def _combined(ref: Reference, fwds: list, combo, low: bool = False) -> dict:
    out = None
    for f, lbl, w in combo:
        g = ref.grad(fwds[f], w, (f, lbl), low=low)[0]
        out = dict(g) if out is None else {k: out[k] + g[k] for k in out}
    return out


def _best_combo(ref: Reference, fwds: list, group: list, cands: dict, delta: dict, tol: float):
    """Over one candidate per forward: the smallest ``score = e / max(tol, 10 * e_eager)``, e = max_rel_err
    of ``delta`` vs the float64 reference of that combination, e_eager = the same for eager in the model's
    dtype (0 for float64).  Returns (score, e, param, combination); the promise holds iff score <= 1."""
    best = (float("inf"), float("inf"), "", None)
    for combo in itertools.product(*[[(f, lbl, w) for lbl, w in cands[f]] for f in group]):
        refg = _combined(ref, fwds, combo)
        e, name = max_rel_err(delta, refg)
        e_eager = max_rel_err(_combined(ref, fwds, combo, low=True), refg)[0] if ref.low is not None else 0.0
        score = e / max(tol, 10 * e_eager)
        if score < best[0]:
            best = (score, e, name, [(f, lbl) for f, lbl, _ in combo])
    return best


def _diagnose(ref: Reference, fwds: list, group: list, cands: dict, delta: dict, step_calls: list, tol: float) -> str:
    """What did the library apply?  Searches, per forward, its allowed candidates plus ones, zeros and every
    rule call's weights / 0-1 keep mask of the same length (the step's calls, any forward's)."""
    ext = {}
    for f in group:
        n = fwds[f].n
        opts = list(cands[f]) + [("ones", torch.ones(n, dtype=torch.float64)), ("zeros", torch.zeros(n, dtype=torch.float64))]
        for ci, (_, w) in enumerate(step_calls):
            if w.shape[0] == n:
                opts += [(f"call{ci}", w.double()), (f"mask(call{ci})", (w != 0).double())]
        seen, ext[f] = set(), []
        for lbl, w in opts:
            if lbl not in seen:
                seen.add(lbl)
                ext[f].append((lbl, w))
    score, e, name, combo = _best_combo(ref, fwds, group, ext, delta, tol)
    if score <= 1:
        return f"the gradients are exactly those of weights {combo} (forward, weights)"
    return f"no simple explanation (closest: {combo}, rel. error {e:.3g})"


def check_backward(ref: Reference, fwds: list, logits: list, group: list, calls: list, delta: dict,
                   reason: Optional[str], tol: float, what: str, strict: bool = False, call0: int = 0,
                   step_calls: Optional[list] = None) -> None:
    """The promise for one ``backward()``: ``delta`` (the .grad increment) must equal
    sum_{f in group} sum_i w_fi grad(l_fi) / N_f, w_f = a rule call's weights for f or (with a reason) ones.
    ``calls``: the rule calls made during this backward; ``call0``: the step-wide index of the first;
    ``step_calls``: all the step's calls so far (for the diagnosis in the failure message only)."""
    step_calls = step_calls if step_calls is not None else calls
    cands: dict = {f: [] for f in group}
    stray = []
    for ci, (z, w) in enumerate(calls, start=call0):
        hits = [f for f in range(len(fwds)) if _same(z, logits[f])]
        for f in hits:
            if f in cands:
                cands[f].append((f"call{ci}", w))
        if not any(f in cands for f in hits):
            stray.append((ci, hits))
            _event("stray rule call: its z matches no forward of this backward")
    # sanity of the reference itself: same logits as the compiled forward (dropout RNG, forward bugs)
    for f in group:  # (float32: vs eager float32, loosely: a wrong dropout mask is off by O(0.1))
        low = ref.low is not None
        zref = ref.grad(fwds[f], torch.ones(fwds[f].n), (f, "ones"), low=low)[1]
        zc = logits[f].detach().double()
        assert torch.allclose(zref, zc, rtol=1e-3 if low else 1e-9, atol=1e-4 if low else 1e-11), \
            f"{what}: forward {f}: the compiled model's logits differ from the eager model's " \
            f"(max abs diff {float((zref - zc).abs().max()):.3g})"
    for f in group:
        if reason is not None and not strict:
            cands[f].append(("ones", torch.ones(fwds[f].n, dtype=torch.float64)))  # dense, reason recorded
    summary = (f"reason recorded: {reason!r}; rule calls (sum w, k): "
               f"{[(round(float(w.sum()), 3), int((w != 0).sum())) for _, w in calls]}; "
               f"stray calls (z matching no forward of this backward): {stray}")
    missing = [f for f in group if not cands[f]]
    if missing:
        raise AssertionError(
            f"{what}: forward(s) {missing} of this backward got no rule call and no fallback reason is recorded"
            + (" (strict: the rule must select every forward)" if strict else "")
            + f"; {_diagnose(ref, fwds, group, cands, delta, step_calls, tol)}; {summary}")
    score, e, name, combo = _best_combo(ref, fwds, group, cands, delta, tol)
    if score <= 1:
        for f, lbl in combo:  # --hypothesis-show-statistics: how often the rows were really selected
            _event("forward selected by the rule" if lbl != "ones" else f"forward dense, reason: {reason[:70]}")
    if score > 1:
        raise AssertionError(
            f"{what}: wrong gradients: rel. error {e:.3g} (param {name}, allowed weights {combo}) > "
            f"{e / score:.3g} (tolerance); "
            f"{_diagnose(ref, fwds, group, cands, delta, step_calls, tol)}; {summary}")


def run_step(cm, model, fwds: list, backward_plan, tol: float, what: str = "step", strict: bool = False):
    """Forwards ``fwds`` through ``cm`` (all under grad), then the backward plan:
    ("sum",): one backward of the summed used losses; ("separate", order): each used loss on its own,
    in ``order``; ("retain", f): the sum with retain_graph=True, then loss f again.  Each backward is
    checked on its own."""
    rule = cm.rule
    calls0 = len(rule.calls)
    ref = Reference(model)
    model.zero_grad(set_to_none=True)
    logits = []
    for fwd in fwds:
        torch.manual_seed(fwd.seed)
        with torch.set_grad_enabled(not fwd.nograd):
            logits.append(cm(*fwd.args, **fwd.kwargs))
    used = [f for f, fwd in enumerate(fwds) if fwd.used]
    losses = {f: F.cross_entropy(logits[f], fwds[f].y) for f in used}
    kind = backward_plan[0]
    if kind == "sum":
        groups = [(used, False)]
    elif kind == "separate":
        groups = [([used[i]], False) for i in backward_plan[1] if i < len(used)]
    else:  # retain
        groups = [(used, True), ([used[backward_plan[1] % len(used)]], False)]
    for gi, (group, retain) in enumerate(groups):
        before = _grads(model)
        c0 = len(rule.calls)
        sum(losses[f] for f in group).backward(retain_graph=retain)
        after = _grads(model)
        delta = {k: after[k] - before[k] for k in after}
        check_backward(ref, fwds, logits, group, rule.calls[c0:], delta, reason_recorded(cm), tol,
                       f"{what}, backward {gi} of forwards {group}", strict=strict, call0=c0 - calls0,
                       step_calls=rule.calls[calls0:])


def compile_fuzz(model, plan, **opts):
    """verify off unless asked: the static proof alone keeps the gathered backward exact (verify's spot check
    would hide a wrong one by falling back to dense)."""
    opts.setdefault("verify", False)
    rule = RecordingRule(plan)
    return capskip_fx.compile(model, rule=rule, backend=opts.pop("backend", "aot_eager"), **opts), rule


@st.composite
def single_steps(draw, min_steps=2, max_steps=3):
    """Steps of one forward each: [(n, seed)]."""
    k = draw(st.integers(min_steps, max_steps))
    return [(draw(st.integers(2, NMAX)), draw(st.integers(0, 2**16))) for _ in range(k)]


def _describe(spec, extra=""):
    note(f"spec = {spec!r}")
    note("generated model:\n" + codegen(spec)[0] + extra)


def run_single_forward_steps(spec, plan, steps, opts, dtype=torch.float64, backend="aot_eager"):
    _describe(spec)
    model = build_model(spec, dtype)
    cm, rule = compile_fuzz(model, plan, backend=backend, **opts)
    for i, (n, seed) in enumerate(steps):
        fwd = make_forward(spec, n, seed, dtype)
        run_step(cm, model, [fwd], ("sum",), TOL[dtype], what=f"step {i} (N={n})")
    return cm


# ----------------------------------------------------------------------------------------------
# Default tier.  Fresh-compile tests: a drawn architecture per example (each compiles anew: ~1-2 s on
# aot_eager, so few examples).  Pooled tests: a handful of row-wise models compiled once per session
# and shared; each example swaps in a new recording rule (``cm.rule = ...``, no recompile) and draws
# batches, keep sets and forward/backward patterns (cheap: most of the examples).

@fast(10)
@given(spec=specs(max_depth=2), plan=plans, steps=single_steps(), opts=OPTIONS)
def test_fuzz_rowwise_models(spec, plan, steps, opts):
    """Row-wise models (Linear, LayerNorm, GELU/ReLU, residual MLPs, GLU, SDPA and einsum token
    attention, batch-major token flattening, token-mixing permutes, Conv1d over tokens, GroupNorm,
    BatchNorm in eval mode, row L2 norm, dropout, drop-path, Embedding inputs, a CLS token), one forward
    per step, 2-3 steps with varying N and keep sets, drawn granule/gather_below/min_rows: the rule's
    weights exactly (or dense with a reason)."""
    run_single_forward_steps(spec, plan, steps, opts)


@fast(5)
@given(spec=specs(pos=None, mask_kw=None, max_depth=1).filter(lambda s: s.pos or s.mask_kw),
       plan=plans, steps=single_steps())
def test_fuzz_side_inputs(spec, plan, steps):
    """A non-batch positional input ``model(x, pos)`` (pos (T, D)) and/or a batch-shaped keyword input
    ``model(x, mask=m)`` (m (N, T)): never a crash, exact or dense with a reason."""
    run_single_forward_steps(spec, plan, steps, {})


@fast(6)
@given(spec=specs(breaks=True, max_depth=2, after_head=True), plan=plans, steps=single_steps())
def test_fuzz_graph_breaks(spec, plan, steps):
    """``torch._dynamo.graph_break()`` between blocks of row-wise models, and after the head: the logits
    passed on as they are (the head selects) or times a learnable scale (dense, with the reason)."""
    run_single_forward_steps(spec, plan, steps, {})


@fast(8)
@given(spec=specs(breaks=None, max_depth=2), plan=plans, steps=single_steps(), granule=st.sampled_from([1, 2]),
       gather=st.sampled_from(["graph", "eager"]))
def test_fuzz_gather_modes(spec, plan, steps, granule, gather):
    """Both gathers: "graph" (a second compiled backward taking all rows and the kept-row index, views in the
    body turned into reshapes) and "eager" (the default), on random row-wise models, graph breaks included:
    exact or dense with a reason; a refused in-graph rewrite keeps the eager gather."""
    cm = run_single_forward_steps(spec, plan, steps, {"gather": gather, "granule": granule})
    event(f"gather {gather}: " + ",".join(r.as_dict()["gather"].split(" ")[0] for r in cm.backend.records if r.plan))


@fast(10)
@given(spec=specs(ops=ROWWISE, extra=MIXING, max_depth=1), plan=plans, steps=single_steps())
def test_fuzz_row_mixing(spec, plan, steps):
    """One cross-example op (BatchNorm1d train, h - h.mean(0) (also detached), softmax / sum / amax /
    F.normalize over the batch, roll, flip, slice+cat, sort, cumsum, index_select, x[perm], an (N, N)
    Gram, MultiheadAttention over the batch) in a row-wise model: the library must detect it and run
    dense with a reason (or be exact anyway)."""
    run_single_forward_steps(spec, plan, steps, {})


@fast(8)
@given(spec=specs(ops=ROWWISE, extra=BACKWARD, max_depth=1), plan=plans, steps=single_steps(2, 3))
def test_fuzz_backward_not_rowwise(spec, plan, steps):
    """A row-wise forward whose backward places rows by position or regenerates randomness in another layout
    (a parameter indexed by arange(N), torch.gather of a parameter by per-row indices, a random mask on a
    token-major value), verify off: the backward proof must refuse it (dense-masked with the reason) or the
    gradient be exact anyway."""
    run_single_forward_steps(spec, plan, steps, {})


@fast(6)
@given(spec=specs(ops=ROWWISE, extra=LAYOUT, max_depth=1), plan=plans, steps=single_steps(2, 4))
def test_fuzz_layout(spec, plan, steps):
    """Row-wise math whose batch is not batch-major inside (token-major flattening into a Linear,
    nn.MultiheadAttention batch_first=True/False): exact or dense with a reason, whatever the order of
    the keep sets (k = 0 first, ...)."""
    run_single_forward_steps(spec, plan, steps, {})


# pooled models ---------------------------------------------------------------------------------

POOL_SPECS = {
    "tokens": Spec(inp="float", din=5, T=3, D=6, C=4, heads=2,
                   blocks=(("linear", "gelu", "attn"), ("ln", "res_mlp", "dropout", "flat_linear")),
                   breaks=(False, False), pool="mean", seed=1),
    "embed": Spec(inp="embed", din=3, T=2, D=4, C=3, heads=2, blocks=(("tokmix", "relu", "linear"),),
                  breaks=(False,), pool="flat", seed=2),
    "breaks": Spec(inp="float2d", din=4, T=2, D=5, C=5, heads=1,
                   blocks=(("linear", "gelu"), ("res_mlp",), ("attn", "ln")), breaks=(True, True, False),
                   pool="first", seed=3),
}
_POOL: dict = {}


@fast(8)
@given(spec=specs(max_depth=2, breaks=None, extra=("row_index_value", "fn_mixing") + BACKWARD), plan=plans,
       steps=single_steps(), idiom=st.sampled_from(IDIOMS))
def test_fuzz_compile_idioms(spec, plan, steps, idiom):
    """The promise when the model is compiled in place (``m.compile()``), per layer or per block with
    ``backend="capskip"``: one rule run per backward, on the returned logits; every other graph drops
    only rows without gradient; refused graphs (row index arithmetic, an undeclared autograd.Function)
    run dense with the reason."""
    _describe(spec, f"\nidiom: {idiom}")
    model = build_model(spec)
    cm = compile_idiom(model, plan, idiom)
    for i, (n, seed) in enumerate(steps):
        run_step(cm, model, [make_forward(spec, n, seed)], ("sum",), TOL[torch.float64],
                 what=f"{idiom} step {i} (N={n})")
    event(f"idiom {idiom}: {capskip_fx.stats(model).mode}")


def pooled(name: str, plan):
    """The session's compiled model for ``name`` with a fresh recording rule.  A model on which a
    fallback reason was recorded (by an earlier example) is rebuilt, so an example only ever accepts
    a dense forward for a reason recorded during that example."""
    entry = _POOL.get(name)
    if entry is None or reason_recorded(entry[1]) is not None:
        model = build_model(POOL_SPECS[name])
        cm = capskip_fx.compile(model, rule=RecordingRule(plan), backend="aot_eager", verify=False)
        entry = _POOL[name] = (model, cm)
    model, cm = entry
    cm.rule = RecordingRule(plan)
    _describe(POOL_SPECS[name])
    return model, cm


@st.composite
def multi_steps(draw, max_steps=2):
    """Steps of 1-3 used forwards (each its own N) plus maybe an unused one (under grad or no_grad), and a
    backward plan.  A forward is (n, seed, used): used is True, False (under grad) or "nograd"."""
    out = []
    for _ in range(draw(st.integers(1, max_steps))):
        nf = draw(st.integers(1, 3))
        fw = [(draw(st.integers(2, NMAX)), draw(st.integers(0, 2**16)), True) for _ in range(nf)]
        if draw(st.booleans()):  # a forward never back-propagated: under grad, or under no_grad (metrics)
            fw.insert(draw(st.integers(0, nf)), (draw(st.integers(2, NMAX)), draw(st.integers(0, 2**16)),
                                                 draw(st.sampled_from([False, "nograd"]))))
        kind = draw(st.sampled_from(["sum", "separate", "retain"]))
        if kind == "separate":
            bp = ("separate", tuple(draw(st.permutations(range(nf)))))
        elif kind == "retain":
            bp = ("retain", draw(st.integers(0, nf - 1)))
        else:
            bp = ("sum",)
        out.append((fw, bp))
    return out


def run_multi_on(model, cm, spec, steps, dtype=torch.float64):
    for i, (fw, bp) in enumerate(steps):
        fwds = [make_forward(spec, n, seed, dtype, used=u is True, nograd=u == "nograd") for n, seed, u in fw]
        run_step(cm, model, fwds, bp, TOL[dtype], what=f"step {i} (forwards {fw}, backward {bp})")


def run_multi(spec, plan, steps, opts=None, dtype=torch.float64, backend="aot_eager"):
    _describe(spec)
    model = build_model(spec, dtype)
    cm, rule = compile_fuzz(model, plan, backend=backend, **(opts or {}))
    run_multi_on(model, cm, spec, steps, dtype)


@fast(120)
@given(name=st.sampled_from(sorted(POOL_SPECS)), plan=plans, steps=multi_steps())
def test_fuzz_multi_forward_pooled(name, plan, steps):
    """1-3 forwards of the same compiled model per step (different batches and N), an unused forward
    (under grad, or under no_grad), summed losses / separate backwards in either order / retain_graph,
    on row-wise models (one with graph breaks): every backward's gradients are the rule's weighted sum
    over its forwards (each forward: its own rule call, or dense with a reason)."""
    model, cm = pooled(name, plan)
    run_multi_on(model, cm, POOL_SPECS[name], steps)


@fast(80)
@given(name=st.sampled_from(sorted(POOL_SPECS)), plan=plans, steps=single_steps(3, 6))
def test_fuzz_keep_sequences_pooled(name, plan, steps):
    """One forward per step, 3-6 steps of varying N with k = 0, 1, some, N (unit or random weights) in
    any order, on the pooled row-wise models."""
    model, cm = pooled(name, plan)
    spec = POOL_SPECS[name]
    for i, (n, seed) in enumerate(steps):
        run_step(cm, model, [make_forward(spec, n, seed)], ("sum",), TOL[torch.float64], what=f"step {i} (N={n})")


# ----------------------------------------------------------------------------------------------
# Slow tier (--runslow)

@pytest.mark.slow
@slow(600)
@given(spec=specs(pos=None, mask_kw=None, breaks=None), plan=plans, steps=single_steps(2, 4), opts=OPTIONS)
def test_slow_fuzz_rowwise_everything(spec, plan, steps, opts):
    run_single_forward_steps(spec, plan, steps, opts)


@pytest.mark.slow
@slow(500)
@given(spec=specs(ops=ROWWISE, extra=MIXING + LAYOUT, pos=None, mask_kw=None, breaks=None),
       plan=plans, steps=single_steps(2, 4), opts=OPTIONS)
def test_slow_fuzz_mixing_and_layout(spec, plan, steps, opts):
    run_single_forward_steps(spec, plan, steps, opts)


@pytest.mark.slow
@slow(500)
@given(spec=specs(ops=ROWWISE, extra=(), pos=None, mask_kw=None, breaks=None), plan=plans,
       steps=multi_steps(max_steps=3), opts=OPTIONS)
def test_slow_fuzz_multi_forward(spec, plan, steps, opts):
    run_multi(spec, plan, steps, opts)


@pytest.mark.slow
@slow(3000)
@given(name=st.sampled_from(sorted(POOL_SPECS)), plan=plans, steps=multi_steps(max_steps=4))
def test_slow_fuzz_multi_forward_pooled(name, plan, steps):
    model, cm = pooled(name, plan)
    run_multi_on(model, cm, POOL_SPECS[name], steps)


@pytest.mark.slow
@slow(400)
@given(spec=specs(ops=ROWWISE, extra=MIXING + LAYOUT, pos=None, mask_kw=None, breaks=None), plan=plans,
       steps=multi_steps(max_steps=3))
def test_slow_fuzz_multi_forward_mixing(spec, plan, steps):
    run_multi(spec, plan, steps)


@pytest.mark.slow
@slow(20)
@given(spec=specs(ops=ROWWISE, extra=LAYOUT + ("roll", "bn", "center"), breaks=None, max_depth=2),
       plan=plans, steps=single_steps(2, 3))
def test_slow_fuzz_inductor_float32(spec, plan, steps):
    """Inductor, float32 (reference float64 on a double copy), tolerance 1e-4."""
    run_single_forward_steps(spec, plan, steps, {}, dtype=torch.float32, backend="inductor")


@pytest.mark.slow
@slow(20)
@given(spec=specs(ops=ROWWISE, extra=LAYOUT, breaks=None, max_depth=2), plan=plans, steps=single_steps(2, 3),
       granule=st.sampled_from([1, 2]))
def test_slow_fuzz_inductor_graph_gather(spec, plan, steps, granule):
    """Inductor, float32, gather="graph": the gathers and reshapes the twin adds, lowered by Inductor."""
    cm = run_single_forward_steps(spec, plan, steps, {"gather": "graph", "granule": granule}, dtype=torch.float32,
                                  backend="inductor")
    event("gather: " + ",".join(r.as_dict()["gather"].split(" ")[0] for r in cm.backend.records if r.plan))


@pytest.mark.slow
@slow(20)
@given(spec=specs(ops=("linear", "gelu", "ln", "res_mlp", "attn", "flat_linear", "droppath"), breaks=None,
                  max_depth=2), plan=plans, steps=multi_steps())
def test_slow_fuzz_inductor_float32_multi_forward(spec, plan, steps):
    run_multi(spec, plan, steps, dtype=torch.float32, backend="inductor")


# ----------------------------------------------------------------------------------------------
# Self-checks of the harness (must pass today: the reference and the matching are right)

SELF_SPEC = Spec(inp="float", din=5, T=3, D=6, C=4, heads=2,
                 blocks=(("linear", "gelu", "attn", "tokmix"), ("ln", "res_mlp", "dropout", "flat_linear")),
                 breaks=(False, False), pool="mean", seed=3)


def _plain_step(cm, model, fwd, w):
    ref = Reference(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(fwd.seed)
    F.cross_entropy(cm(*fwd.args), fwd.y).backward()
    return max_rel_err(_grads(model), ref.grad(fwd, w, "w")[0])


def test_harness_matches_library_on_rowwise_model():
    """One compiled row-wise model (dropout included), rules swapped without recompiling:
    rule="dense" == the eager reference with w = 1; Forced keep sets == w = 0/1; the recording rule
    through the full oracle (k = some, 0, N, 1; weighted).  Must pass today."""
    model = build_model(SELF_SPEC)
    cm = capskip_fx.compile(model, rule="dense", backend="aot_eager")
    for n, seed in [(6, 0), (4, 1), (9, 2)]:
        e, name = _plain_step(cm, model, make_forward(SELF_SPEC, n, seed), torch.ones(n))
        assert e < 1e-10, ("dense", n, e, name)
        assert capskip_fx.stats(cm).fallback is None, (
            f"rule='dense' on a row-wise model is a rule, not a fallback: got fallback {capskip_fx.stats(cm).fallback!r}")
    for keep in ([0, 2], [1], [0, 1, 2, 3, 4, 5]):
        cm.rule = Forced(keep=lambda n, keep=keep: torch.tensor(keep))
        for n, seed in [(6, 3), (7, 4)]:
            w = torch.zeros(n)
            w[keep] = 1
            e, name = _plain_step(cm, model, make_forward(SELF_SPEC, n, seed), w)
            assert e < 1e-10, ("forced", keep, n, e, name)
            assert capskip_fx.stats(cm).fallback is None, (
                f"forced keep {keep} on a row-wise model should run without a dense fallback, got {capskip_fx.stats(cm).fallback!r}")
            assert capskip_fx.stats(cm).kept == len(keep), (
                f"forced keep {keep} should keep exactly those {len(keep)} rows, kept {capskip_fx.stats(cm).kept!r}")
    rule = RecordingRule([("some", True, 1), ("none", False, 2), ("all", True, 3), ("one", True, 4)])
    cm.rule = rule
    for i, n in enumerate([6, 6, 8, 5, 7]):
        run_step(cm, model, [make_forward(SELF_SPEC, n, 10 + i)], ("sum",), 1e-8, what=f"step {i}")
    assert rule.count == 5, f"the recording rule should be asked once per step (5 steps), was asked {rule.count!r} times"
    assert reason_recorded(cm) is None, f"the row-wise model should record no dense reason, got {reason_recorded(cm)!r}"
    assert [r["backward"] for r in capskip_fx.report(cm)] == ["selected rows"], (
        f"one graph, selected, whatever the rule asked; report says {[r['backward'] for r in capskip_fx.report(cm)]!r}")


def test_harness_oracle_catches_wrong_weights():
    """The oracle is not vacuous: gradients of another keep set are rejected."""
    model = build_model(SELF_SPEC)
    fwd = make_forward(SELF_SPEC, 6, 0)
    ref = Reference(model)
    w_true = torch.tensor([1.0, 0, 0, 2.0, 0, 0], dtype=torch.float64)
    g, z = ref.grad(fwd, torch.tensor([1.0, 0, 0, 0, 0, 0], dtype=torch.float64), "other")
    with pytest.raises(AssertionError, match="wrong gradients"):
        check_backward(ref, [fwd], [z], [0], [(z, w_true)], g, None, 1e-8, "selfcheck")
    with pytest.raises(AssertionError, match="no rule call"):
        check_backward(ref, [fwd], [z], [0], [], g, None, 1e-8, "selfcheck")
    check_backward(ref, [fwd], [z], [0], [], ref.grad(fwd, torch.ones(6), "ones")[0], "a reason", 1e-8, "selfcheck")


# ----------------------------------------------------------------------------------------------
# Regression tests: known bugs, deterministic

@pytest.mark.parametrize("order", ["misclassified_first", "correct_first"])
def test_regression_two_forwards_one_backward_capskip(order):
    """capskip b=1: x1 all misclassified (all kept), x2 all correct (all skipped): grads = grad CE1 + 0."""
    torch.manual_seed(0)
    model = MLP(d=6, hidden=10, classes=4).double()
    cm = capskip_fx.compile(model, rule="capskip", budget=1.0, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    x1 = torch.randn(8, 6, generator=g, dtype=torch.float64)
    x2 = torch.randn(7, 6, generator=g, dtype=torch.float64)
    with torch.no_grad():
        y1 = (model(x1).argmax(1) + 1) % 4
        y2 = model(x2).argmax(1)
    ref = copy.deepcopy(model)
    if order == "misclassified_first":
        z1, z2 = cm(x1), cm(x2)
    else:
        z2, z1 = cm(x2), cm(x1)
    (F.cross_entropy(z1, y1) + F.cross_entropy(z2, y2)).backward()
    F.cross_entropy(ref(x1), y1).backward()
    e, name = max_rel_err(_grads(model), _grads(ref))
    assert e < 1e-8, f"rel. error {e:.3g} at {name}; stats {capskip_fx.stats(cm)}; report {capskip_fx.report(cm)}"


class MHANet(nn.Module):
    def __init__(self, d=8, t=3, classes=4):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


class RollNet(nn.Module):
    def __init__(self, d=8, classes=4):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.inp(x).mean(1)
        h = self.fc(h)
        h = h + torch.roll(h, 1, 0)
        return self.head(F.gelu(h))


def _fwd(n, seed, t=3, din=5, classes=4, **kw):
    g = torch.Generator().manual_seed(seed)
    return Fwd((torch.randn(n, t, din, generator=g, dtype=torch.float64),), kw,
               torch.randint(0, classes, (n,), generator=g), seed=seed)


@pytest.mark.parametrize("net", [MHANet, RollNet])
def test_regression_verify_used_up_by_empty_step(net):
    """First step keeps 0 rows, later ones keep some: every step exact (or dense with a reason)."""
    torch.manual_seed(0)
    model = net().double()
    cm, rule = compile_fuzz(model, [("none", False, 0), ("some", False, 1), ("some", True, 2), ("one", False, 3)])
    for i, n in enumerate([8, 8, 8, 6]):
        run_step(cm, model, [_fwd(n, 10 + i)], ("sum",), 1e-8, what=f"step {i} (N={n})")


class BreakThenBatchNormNet(nn.Module):
    """Linear blocks, a graph break, then BatchNorm in train mode before the head: the graph that returns the
    logits is refused (cross-example), the one before the break ends in a token-shaped Linear output."""

    def __init__(self, d=5, classes=4):
        super().__init__()
        self.inp, self.fc = nn.Linear(5, d), nn.Linear(d, d)
        self.bn, self.fc2, self.head = nn.BatchNorm1d(d), nn.Linear(d, d), nn.Linear(d, classes)

    def forward(self, x):
        h = self.fc(self.inp(x))
        torch._dynamo.graph_break()
        h = self.fc2(self.bn(h.transpose(1, 2)).transpose(1, 2))
        return self.head(h.mean(1))


@pytest.mark.parametrize("sizes", [(2, 5, 5, 4), (6, 6, 6, 6)], ids=["ragged", "fixed"])
@pytest.mark.parametrize("idiom", ("compile", "wrapped") + IDIOMS)
@pytest.mark.parametrize("plan", [[("none", False, 0)], [("some", False, 1)]], ids=["none", "some"])
def test_regression_graph_before_a_refused_head_selects_nothing_of_its_own(plan, idiom, sizes):
    """Found by the slow fuzzer (full scale): the head graph refused, the graph before the break took its
    last Linear's (N, 1, d) output for token logits and ran the rule on it as a head of its own, dropping
    rows of a dense step (relative error 1 in its parameters' gradients).  A refused graph that returned
    the logits now counts as a head for the graphs upstream of it: they keep the rows that carry gradient
    (test_hf's GPT-2, whose loss graph after the head is refused and returns no logits, still selects).
    The string backend's idioms too, where the graph after the break runs eagerly (a fixed batch size: its static
    graph) or holds the head alone: the step recorded dense at the forward (eager logits) is this
    backward's, and no graph of it selects."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BreakThenBatchNormNet().double()
    if idiom == "compile":
        cm, rule = compile_fuzz(model, plan)
    elif idiom == "wrapped":
        rule = RecordingRule(plan)
        cm = InPlace(torch.compile(model, backend="capskip", options={"rule": rule, "backend": "aot_eager",
                                                                      "verify": False}), rule)
    else:
        cm = compile_idiom(model, plan, idiom)
        rule = cm.rule
    for i, n in enumerate(sizes):
        run_step(cm, model, [_fwd(n, 40 + i, t=1)], ("sum",), 1e-8, what=f"step {i} (N={n})")
    if idiom in ("compile", "wrapped", "in_place"):  # the head in the refused graph (or eager): no rule runs
        assert all(z.shape[-1] == 4 for z, _ in rule.calls), "the rule ran on a hidden Linear output"
        assert capskip_fx.stats(cm if idiom == "compile" else cm.compiled).mode == "dense"


class SortNet(nn.Module):
    def __init__(self, d=6, classes=4):
        super().__init__()
        self.fc = nn.Linear(5, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.fc(x.mean(1))
        h = h + torch.sort(h, dim=0).values
        return self.head(h)


def test_regression_sort_over_batch():
    """torch.sort(h, dim=0) couples rows: no crash; exact or dense with a reason."""
    torch.manual_seed(0)
    model = SortNet().double()
    cm, rule = compile_fuzz(model, [("some", True, 1), ("none", False, 2), ("some", False, 3)])
    for i, n in enumerate([8, 8, 6]):
        run_step(cm, model, [_fwd(n, 20 + i)], ("sum",), 1e-8, what=f"step {i} (N={n})")


class PosNet(nn.Module):
    def __init__(self, d=6, classes=4):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, pos):
        h = self.inp(x) + pos
        return self.head(F.gelu(self.fc(h)).mean(1))


@pytest.mark.parametrize("t,ns", [(3, [8, 8, 5]), (4, [4, 6, 4])], ids=["T!=N", "T==N"])
def test_regression_positional_nonbatch_input(t, ns):
    """model(x, pos) with pos (T, D) not batch-shaped: no crash, exact."""
    torch.manual_seed(0)
    model = PosNet().double()
    cm, rule = compile_fuzz(model, [("some", True, 1), ("all", False, 2), ("one", True, 3)])
    for i, n in enumerate(ns):
        fwd = _fwd(n, 30 + i, t=t)
        fwd.args = fwd.args + (torch.randn(t, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(i)),)
        run_step(cm, model, [fwd], ("sum",), 1e-8, what=f"step {i} (N={n}, T={t})")


class MaskNet(nn.Module):
    def __init__(self, d=6, classes=4):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, mask=None):
        h = self.inp(x) * mask.unsqueeze(-1)
        return self.head(F.gelu(self.fc(h)).mean(1))


def test_regression_batch_keyword_input():
    """model(x, mask=m) with m (N, T): no crash, exact."""
    torch.manual_seed(0)
    model = MaskNet().double()
    cm, rule = compile_fuzz(model, [("some", True, 1), ("all", False, 2), ("none", False, 3)])
    for i, n in enumerate([8, 8, 5]):
        g = torch.Generator().manual_seed(40 + i)
        fwd = _fwd(n, 40 + i, mask=torch.rand(n, 3, generator=g, dtype=torch.float64))
        run_step(cm, model, [fwd], ("sum",), 1e-8, what=f"step {i} (N={n})")


class BNNet(nn.Module):
    def __init__(self, d=6, classes=4):
        super().__init__()
        self.fc = nn.Linear(5, d)
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.fc(x)
        h = self.bn(h)
        return self.head(F.relu(h))


def test_regression_on_coupling_error_batchnorm():
    """on_coupling="error" + BatchNorm1d in train mode: ValueError naming the op, at the first step."""
    torch.manual_seed(0)
    model = BNNet().double().train()
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, on_coupling="error", backend="aot_eager")
    x = torch.randn(8, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (8,))
    with pytest.raises(ValueError, match=r"(?i)batch_?norm|var_mean|self\.bn"):
        F.cross_entropy(cm(x), y).backward()


def test_regression_same_graph_twice_one_step():
    """Two forwards of the same shapes through the same graph, one backward: exact for both
    (strict: both forwards get their own rule call; a plain MLP has no reason to run dense)."""
    torch.manual_seed(0)
    model = MLP(d=6, hidden=10, classes=4).double()
    cm, rule = compile_fuzz(model, [("some", True, 1), ("some", True, 2), ("one", False, 3), ("all", True, 4)])
    for i in range(2):
        g = torch.Generator().manual_seed(50 + i)
        fwds = [Fwd((torch.randn(8, 6, generator=g, dtype=torch.float64),), {},
                    torch.randint(0, 4, (8,), generator=g), seed=j) for j in range(2)]
        run_step(cm, model, fwds, ("sum",), 1e-8, what=f"step {i}", strict=True)


class DropPathNet(nn.Module):
    """Drop-path style per-row scaling by a fixed per-row tensor: a slice ``scale[:N]`` of a buffer."""

    def __init__(self, d=6, classes=4):
        super().__init__()
        self.fc = nn.Linear(5, d)
        self.head = nn.Linear(d, classes)
        self.register_buffer("scale", torch.tensor([1.0, 0.0, 2.0, 0.5, 1.5, 0.0, 3.0, 1.0, 0.25]))

    def forward(self, x):
        h = self.fc(x)
        h = h * self.scale[:h.shape[0]].view(-1, 1)
        return self.head(F.gelu(h))


@pytest.mark.parametrize("first", ["none", "prefix"])
def test_regression_rowslice_of_static_buffer(first):
    """Found by this fuzzer (on e3ca348).  ``h * buf[:N]``: the backward sliced the (static, not gathered)
    buffer with the batch symbol, i.e. ``buf[:kb]`` instead of the kept rows' ``buf[idx]``.  The first
    gathered step's verify caught it, unless that step kept no rows or a prefix (``buf[:kb] == buf[idx]``):
    then later steps were silently wrong.  Every step: exact, or dense with a reason."""
    torch.manual_seed(0)
    model = DropPathNet().double()
    cm, rule = compile_fuzz(model, [(first, False, 0), ("some", False, 5), ("some", True, 6)])
    for i, n in enumerate([8, 8, 7]):
        g = torch.Generator().manual_seed(60 + i)
        run_step(cm, model, [Fwd((torch.randn(n, 5, dtype=torch.float64, generator=g),), {},
                                 torch.randint(0, 4, (n,), generator=g), seed=i)], ("sum",), 1e-8, what=f"step {i}")

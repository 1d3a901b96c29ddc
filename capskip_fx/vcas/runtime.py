"""Runs a VCAS backward: the segments of segment_backward.py, SampleA between them.

Per step (``VcasBackward.__call__``, what the selected-row backward calls as its compiled graph):
  - segment 0 runs on all rows it was given (the example-level rule's kept rows);
  - at cut ``j`` the incoming gradient's per-row norms give soft-top-k probabilities with
    ``sum p = int(rho_j * live)`` (``live``: the rows that carry gradient, from the caller's
    ``live_rows``); rows are kept with those probabilities and scaled by ``1/p`` (only where
    ``rho_j`` drops below the cut above it: VCAS resamples only there); the next segments run on the
    kept rows only (their saved activations gathered), dropped rows stay dropped;
  - each sampled weight-gradient matmul (``capskip::sampled_wgrad``) samples token rows (``nu``);
  - batch-shaped outputs (input gradients) are scattered back with zeros for dropped rows.
Every ``freq`` steps the step is a probe instead (see controller.py): the returned gradient is the
exact one (two halves), and the controller updates ``s``, ``rho``, ``nu``.  SampleW's variance is
measured as the reference's: in the probe's activation-sampled passes, on the rows each pass carries
(kept rows scaled by ``1/p``), the mean over the passes; while every ``rho`` is 1 (no such pass) on
the whole batch's exact rows.
Host reads: none on a sampled step with ``sampler="systematic"`` (sizes are the budgets, known on the
host); with ``"bernoulli"`` one per resampling cut and per sampled matmul.  A probe step reads once
for its variances and once per boundary for the new schedule.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .. import ops
from ..rows import conform, gather_rows, scatter_rows
from ..runtime.executors import SampledBackward
from ..symbolic import Spec, evaluate
from .controller import VCAS, ProbeResult, VcasController
from .sampling import bernoulli_keep, closed_form_var, ht_scale, sample_probs, soft_topk, systematic_keep, vcas_k
from .segment_backward import Segments


def _row_norms(x: Tensor, spec: Spec, n: int) -> Tensor:
    y = x.unflatten(spec.dim, (n, spec.factor)).movedim(spec.dim, 0).reshape(n, -1)
    return torch.linalg.vector_norm(y.float() if y.dtype != torch.float64 else y, dim=1)


def _scale_rows(x: Tensor, spec: Spec, scale: Tensor, n: int) -> Tensor:
    shape = [1] * (x.dim() + 1)
    shape[spec.dim] = n
    return (x.unflatten(spec.dim, (n, spec.factor)) * scale.to(x.dtype).view(shape)).flatten(spec.dim, spec.dim + 1)


class VcasBackward(SampledBackward):
    """The boxed callable SelectedRowBackward calls as the compiled backward (a SampledBackward: the runtime
    runs it as VCAS's segments, runtime/executors.py)."""

    def __init__(self, cfg: VCAS, state, record, min_rows: int = 2, gather_below: float = 0.9):
        self._boxed_call = True
        self.cfg = cfg
        self.gather_below = gather_below  # keep more than this fraction: mask the rows instead of gathering
        self.state = state
        self.record = record
        self.min_rows = min_rows
        self.key = ops.register(self)
        self.ctrl = VcasController(cfg)
        self.split: Optional[Segments] = None
        self.compiled: list = []
        self.in_specs: list[Spec] = []
        self.slots = 0
        self.wmode = "sample"  # "sample" | "exact" (plain matmul) | "probe" (exact + stash dW, variance)
        self._stash: dict[int, list] = {}
        self._wvar: dict[int, Tensor] = {}  # per slot: SampleW's variance summed over a probe's sampled passes
        self.wrows: list[tuple[int, int, int, int]] = []  # (slot, kept, total, out*in) of the last pass
        self.seg_rows: list[int] = []  # rows each segment ran on in the last pass
        self._shapes: dict = {}
        self._sampled_out: list[int] = []  # static outputs produced below the first cut
        self.live_rows: Optional[int] = None  # set by the caller per call: rows that carry gradient
        self._live = 0  # rows carrying gradient in the segment running now (of self._n)
        self._n = 0
        state.add_runner(self)

    def state_dict(self) -> dict:
        return self.ctrl.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ctrl.load_state_dict(state)

    def finish(self, split: Segments, compiled: list, in_specs: list[Spec], slots: int) -> None:
        self.split, self.compiled, self.in_specs, self.slots = split, compiled, in_specs, slots
        producer = {name: i for i, s in enumerate(split.segments) for name in s.outputs}
        self._sampled_out = [j for j, f in enumerate(split.final)
                             if f[0] == "val" and producer.get(f[1], 0) >= 1 and split.specs[f[1]].kind == "static"]
        self.ctrl.ensure(len(split.boundaries), slots)

    # -- SampleW (called from inside the compiled segments) ------------------------------------
    def _nu(self, slot: int) -> float:
        return self.ctrl.nu[slot] if self.cfg.sample_w else 1.0

    def wgrad(self, g: Tensor, x: Tensor, slot: int) -> Tensor:
        nu = self._nu(slot)
        mode = self.wmode
        t, oi = g.shape[0], g.shape[1] * x.shape[1]
        if mode == "exact" or (mode == "sample" and nu >= 1.0):
            self.wrows.append((slot, t, t, oi))
            return torch.mm(g.t(), x)
        q = _row_norms(g, Spec("batch"), t) * _row_norms(x, Spec("batch"), x.shape[0])
        if mode == "probe":  # an exact half: its gradient (SGD variance) and its token-row scores
            out = torch.mm(g.t(), x)
            self._stash.setdefault(slot, []).append((out.detach().clone(), q))
            self.wrows.append((slot, t, t, oi))
            return out
        if mode == "actvar":  # an activation-sampled probe pass: exact product, SampleW's variance on
            # the rows this pass carries (kept rows scaled by 1/p), as the reference's linear.py 54-58
            self._wvar[slot] = self._wvar.get(slot, 0.0) + _leverage_var(q, nu)
            self.wrows.append((slot, t, t, oi))
            return torch.mm(g.t(), x)
        gen = self.state.generator(g.device)
        if self.cfg.sampler == "systematic":
            # slots: the budget over the token rows that can carry gradient (host-known); the draw's
            # probabilities are the reference's, int(nu * rows with q > 0) on the device, within the slots
            k = vcas_k(nu, t * self._live // max(self._n, 1))
            if k <= 0 or k >= t:  # 0: exact, as the reference's leverage_k
                self.wrows.append((slot, t, t, oi))
                return torch.mm(g.t(), x)
            p = sample_probs(q, nu, (q > 0).sum(), cap=k)
            idx, hit = systematic_keep(p, k, gen)
            scale = torch.where(hit, 1.0 / p.index_select(0, idx).clamp_min(1e-300), 0.0)
        else:
            p = sample_probs(q, nu, (q > 0).sum())  # int(T nu) rows; 0: exact, as the reference's leverage_k
            idx = bernoulli_keep(p, gen).nonzero().squeeze(1)  # the host read of this matmul
            scale = 1.0 / p.index_select(0, idx)
            k = idx.numel()
        if k > self.gather_below * t:  # copying the kept rows would cost more than the dropped rows save: mask
            full = torch.zeros_like(p).index_copy_(0, idx, scale)
            self.wrows.append((slot, t, t, oi))
            return torch.mm((g * full.to(g.dtype).unsqueeze(1)).t(), x)
        self.wrows.append((slot, k, t, oi))
        return torch.mm(g.index_select(0, idx).mul_(scale.to(g.dtype).unsqueeze(1)).t(), x.index_select(0, idx))

    # -- one backward --------------------------------------------------------------------
    def __call__(self, args: list) -> list:
        a = list(args)
        args.clear()  # boxed call: drop the caller's references to the saved activations
        n0 = self._rows(a)
        live = self.live_rows if self.live_rows is not None else n0
        probe = self.ctrl.is_probe() and (self.cfg.sample_act or self.cfg.sample_w) and n0 >= 4
        if probe:
            outs = self._probe(a, n0, live)
        else:
            outs = self._run(a, n0, live, rows=None, act=self.cfg.sample_act, wmode="sample")[0]
        self.ctrl.step += 1
        last = self.state.last
        last.vcas = {"probe": probe, "segment_rows": list(self.seg_rows), "s": self.ctrl.s,
                     "rho": list(self.ctrl.rho), "nu": list(self.ctrl.nu),
                     "wgrad_rows": [(k, t) for _, k, t, _ in self.wrows]}
        return outs

    def wgrad_flops(self) -> int:
        """FLOPs of the last pass's sampled weight-gradient matmuls (inside the op: invisible to
        FlopCounterMode, which sees the op, not the matmul it runs)."""
        return sum(2 * k * oi for _, k, _, oi in self.wrows)

    def exact(self, args: list) -> list:
        """The same segments on the same rows with no sampling (verification, tests)."""
        a = list(args)
        args.clear()
        n0 = self._rows(a)
        return self._run(a, n0, n0, rows=None, act=False, wmode="exact")[0]

    def _rows(self, a: list) -> int:
        for x, s in zip(a, self.in_specs):
            if s.kind == "batch":
                return x.shape[s.dim] // s.factor
        raise RuntimeError("VCAS backward: no batch-shaped input")

    def _shape(self, spec: Spec, n: int):
        key = (id(spec), n)
        if key not in self._shapes:
            sym = self.split.sym
            self._shapes[key] = (tuple(evaluate(e, sym, n) for e in spec.sizes),
                                  tuple(evaluate(e, sym, n) for e in spec.strides))
        return self._shapes[key]

    def _take(self, x: Any, spec: Spec, src_rows: Optional[Tensor], src_n: int, rows: Optional[Tensor],
              n: int, n0: int) -> Any:
        """Value produced on ``src_rows`` (None: all n0) -> on ``rows`` (a subset)."""
        if spec.kind == "symint":
            return evaluate(spec.expr, self.split.sym, n)
        if spec.kind != "batch":
            return x
        if rows is src_rows:
            return conform(x, *self._shape(spec, n))
        if src_rows is None:
            rel = rows
        else:
            key = (id(src_rows), id(rows))
            rel = self._rel.get(key)
            if rel is None:  # positions of `rows` within `src_rows` (a superset)
                inv = torch.full((n0,), -1, dtype=torch.long, device=rows.device)
                inv[src_rows] = torch.arange(src_rows.numel(), device=rows.device)
                rel = self._rel[key] = inv[rows]
        return gather_rows(x, spec, rel, src_n, *self._shape(spec, n))

    def _run(self, a: list, n0: int, live: int, rows: Optional[Tensor], act: bool, wmode: str):
        """One pass over the segments (``live`` of the ``n0`` rows carry gradient).  Returns (outputs at
        n0 rows, exact boundary norms per cut)."""
        split = self.split
        self.wmode = wmode
        self.wrows = []
        self.record.matmul_shapes = []
        self.seg_rows = []
        self._rel: dict = {}
        gen = None
        n = n0 if rows is None else rows.numel()
        live = live if rows is None else n  # a probe's half: its rows, as many as carry gradient
        top = live  # SampleA's budgets are fractions of the rows carrying gradient at the top
        systematic = self.cfg.sampler == "systematic"
        vals: dict[str, tuple] = {}
        norms: list[Tensor] = []
        n_ref = None
        rho_all = self.ctrl.rho
        resample = [act and r < (1.0 if j == 0 else rho_all[j - 1]) for j, r in enumerate(rho_all)]
        for i, seg in enumerate(split.segments):
            j = i - 1
            if i > 0 and (wmode == "probe" or resample[j] or (j == 0 and any(resample))):
                b, b_rows, b_n = vals[seg.boundary]
                spec = split.specs[seg.boundary]
                nrm = _row_norms(b, spec, b_n)
                norms.append(nrm if b_rows is None else (b_rows, nrm))
                if n_ref is None:  # rows that carry gradient (the rule's kept rows)
                    n_ref = (nrm > 0).sum()
                rho = rho_all[j]
                k = vcas_k(rho, top)  # slots: int(rho * top) rows; 0: no sampling (the reference)
                draw = None  # (slot rows, their 1/p scales (0: not kept), rows kept; host-known)
                if resample[j] and systematic and 0 < k < b_n:
                    gen = gen or self.state.generator(b.device)
                    p = sample_probs(nrm, rho, n_ref, cap=k)  # the reference's int(rho * n_ref), within k
                    rel, hit = systematic_keep(p, k, gen)
                    draw = rel, torch.where(hit, 1.0 / p.index_select(0, rel).clamp_min(1e-300), 0.0), k
                elif resample[j] and not systematic:
                    gen = gen or self.state.generator(b.device)
                    p = sample_probs(nrm, rho, n_ref)  # int(n rho) rows; 0: no sampling (the reference)
                    keep = bernoulli_keep(p, gen)
                    rel = torch.argsort((~keep).to(torch.int8), stable=True)  # kept rows first
                    draw = rel, ht_scale(p, keep).index_select(0, rel), int(keep.sum())  # the host read of this cut
                    if draw[2] == 0:  # no row survived: the exact gradient passes (act_sampler.py 32-33)
                        draw = None
                if draw is not None:
                    rel, scale, kept = draw
                    if kept > self.gather_below * b_n:  # gathers would cost more than they save: mask
                        full = torch.zeros_like(nrm, dtype=scale.dtype).index_copy_(0, rel, scale)
                        vals[seg.boundary] = (_scale_rows(b, spec, full, b_n), b_rows, b_n)
                        live = kept  # of b_n rows: SampleW's budgets below count these
                    else:
                        cb = min(b_n, max(kept, self.min_rows))
                        rel, scale = _pad(rel, scale, cb, b_n)  # pad rows: further unkept rows, scale 0
                        b = b.unflatten(spec.dim, (b_n, spec.factor)).index_select(spec.dim, rel)
                        b = _scale_rows(b.flatten(spec.dim, spec.dim + 1), spec, scale, cb)
                        rows = rel if b_rows is None else b_rows.index_select(0, rel)
                        n, live = cb, kept
                        vals[seg.boundary] = (b, rows, n)
            inputs = []
            for kind, ref in seg.inputs:
                if kind == "arg":
                    inputs.append(self._take(a[ref], self.in_specs[ref], None, n0, rows, n, n0))
                else:
                    x, x_rows, x_n = vals[ref]
                    inputs.append(self._take(x, split.specs[ref], x_rows, x_n, rows, n, n0))
            self.seg_rows.append(n)
            self._live, self._n = live, n
            outs = self.compiled[i](inputs)
            for name, o in zip(seg.outputs, outs):
                vals[name] = (o, rows, n)
        final = []
        for kind, ref in split.final:
            if kind == "arg":
                final.append(a[ref])
            elif kind == "const":
                final.append(ref)
            else:
                x, x_rows, x_n = vals[ref]
                spec = split.specs[ref]
                if spec.kind == "batch" and x is not None and x_rows is not None:
                    x = scatter_rows(x, spec, x_rows, n0)
                final.append(x)
        return final, norms

    # -- the controller's probe ----------------------------------------------------------
    def _probe(self, a: list, n0: int, live: int) -> list:
        gen = self.state.generator(a[next(i for i, s in enumerate(self.in_specs) if s.kind == "batch")].device)
        perm = torch.randperm(n0, generator=gen, device=gen.device)
        halves = [perm[: n0 // 2].sort().values, perm[n0 // 2:].sort().values]
        self._stash = {}
        parts, norm_parts = [], []
        for h in halves:
            outs, nrm = self._run(a, n0, live, rows=h, act=False, wmode="probe")
            parts.append(outs)
            norm_parts.append(nrm)
        exact = [x + y if isinstance(x, Tensor) and isinstance(y, Tensor) else x for x, y in zip(*parts)]
        sel = self._sampled_out

        def sq(x: Tensor) -> Tensor:  # on the device: one host read per probe, not one per tensor
            return x.double().pow(2).sum()

        zero = torch.zeros((), dtype=torch.float64, device=gen.device)
        sgd = sum((sq(parts[0][j] - parts[1][j]) for j in sel if isinstance(parts[0][j], Tensor)), zero)
        w_var, w_sgd = [], []
        for slot in range(self.slots):
            st = self._stash.get(slot, [])
            # rho = 1 everywhere: the reference's sampled pass carries every row unscaled, i.e. the
            # whole batch's exact token rows (both halves)
            w_var.append(_leverage_var(torch.cat([st[0][1], st[1][1]]), self._nu(slot)) if len(st) == 2 else zero)
            w_sgd.append(sq(st[0][0] - st[1][0]) if len(st) == 2 else zero)
        self._stash = {}
        act_var = zero
        if self.cfg.sample_act and any(r < 1.0 for r in self.ctrl.rho):  # rho = 1: no draw, no variance
            self._wvar = {}
            for _ in range(self.cfg.probes):  # distinct draws (the reference reseeded each pass identically)
                outs, _ = self._run(a, n0, live, rows=None, act=True, wmode="actvar")
                act_var = act_var + sum((sq(outs[j] - exact[j]) for j in sel if isinstance(outs[j], Tensor)),
                                        zero) / self.cfg.probes
            # SampleW's variance where the reference measures it: in the activation-sampled passes
            # (vcas_trainer.py 58-62), their mean (sample_scheme.py 64)
            w_var = [self._wvar[slot] / self.cfg.probes if slot in self._wvar else zero for slot in range(self.slots)]
            self._wvar = {}
        sgd, act_var, *w = torch.stack([sgd, act_var, *w_var, *w_sgd]).tolist()
        w_var, w_sgd = w[:self.slots], w[self.slots:]
        norms = []
        for j in range(len(self.split.boundaries)):
            nm = torch.cat([_unpack(norm_parts[0][j]), _unpack(norm_parts[1][j])])
            norms.append(nm[nm > 0])  # rho is a fraction of the rows that carry gradient (as n_ref)
        self.ctrl.update(ProbeResult(sgd_var=sgd, act_var=act_var, w_var=w_var, w_sgd_var=w_sgd, norms=norms))
        if not self.cfg.sample_act:
            self.ctrl.rho = [1.0] * len(self.ctrl.rho)
        self.wmode = "sample"
        return exact


def _leverage_var(q: Tensor, nu: float) -> Tensor:
    """SampleW's added variance at budget ``int(nu * rows)`` over token-row scores ``q`` (the
    reference's ``cal_leverage_var``, vcas/layers/utils.py 32-39); budget 0: huge (its 1e-9 probs)."""
    return closed_form_var(q, soft_topk(q, vcas_k(nu, (q > 0).sum())))


def _pad(rel: Tensor, scale: Tensor, cb: int, n: int) -> tuple[Tensor, Tensor]:
    """The first ``cb`` slots of (rows, scales); fewer than ``cb``: more distinct rows of the ``n``, scale 0."""
    if rel.numel() >= cb:
        return rel[:cb], scale[:cb]
    rest = torch.ones(n, dtype=torch.bool, device=rel.device).index_fill_(0, rel, False)
    more = torch.argsort((~rest).to(torch.int8), stable=True)[:cb - rel.numel()]
    return torch.cat([rel, more]), torch.cat([scale, scale.new_zeros(cb - rel.numel())])


def _unpack(x) -> Tensor:
    return x[1] if isinstance(x, tuple) else x

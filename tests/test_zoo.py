"""timm zoo sweep at tiny sizes: selected-row gradients == float64 dense-masked eager reference with a
forced keep set, or the expected refusal (BatchNorm in train mode).  aot_eager: same passes, fast.

``benchmarks/zoo_report.py`` runs the same sweep and writes benchmarks/results/zoo.md.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import capskip_fx

pytestmark = [pytest.mark.usefixtures("many_compiles"), pytest.mark.heavy]  # every test compiles its own model

N = 6
KEEP = (1, 4)  # forced keep set: 2 of 6 rows, gathered


def _timm(arch, **kw):
    import timm
    kw = {"num_classes": 10, **kw}
    return lambda: timm.create_model(arch, pretrained=False, **kw)


def _mixer(**kw):
    def make():
        from timm.models.mlp_mixer import MlpMixer
        return MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=1, embed_dim=32, **kw)
    return make


def _resmlp():
    from timm.models.mlp_mixer import Affine, ResBlock
    return _mixer(block_layer=ResBlock, norm_layer=Affine, mlp_ratio=4)()


def _convnext():
    from timm.models.convnext import ConvNeXt  # always 4 stages: 1 block each, tiny widths
    return ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 8, 16, 16), num_classes=10)


# name: (factory, config shown in the report, expected: "selected" | "refused")
ZOO = {
    "vit_tiny": (_timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1),
                 "depth 1, img 32, patch 8", "selected"),
    "deit_tiny": (_timm("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=1),
                  "depth 1, img 32, patch 8", "selected"),
    "deit_tiny_distilled": (_timm("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, depth=1),
                            "depth 1, img 32, patch 8 ((head(cls) + head_dist(dist)) / 2)", "selected"),
    "deit_small": (_timm("deit_small_patch16_224", img_size=32, patch_size=16, depth=1, num_classes=100),
                   "DeiT-S width (384, 6 heads), depth 1, img 32, patch 16, 100 classes", "selected"),
    "cait_xxs24": (_timm("cait_xxs24_224", img_size=32, patch_size=8, depth=1, depth_token_only=1),
                   "depth 1 + 1 class-attention block, img 32, patch 8", "selected"),
    "beit_base": (_timm("beit_base_patch16_224", img_size=32, patch_size=8, depth=1, embed_dim=32, num_heads=2),
                  "depth 1, dim 32, 2 heads, img 32, patch 8 (relative position bias)", "selected"),
    "swin_tiny": (_timm("swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4,
                        depths=(1, 1), num_heads=(1, 2), embed_dim=16, drop_path_rate=0.0),
                  "2 stages x 1 block, dim 16, window 4, img 32 (shifted windows, patch merging)", "selected"),
    "mixer": (_mixer(), "1 block, dim 32, img 32, patch 8", "selected"),
    "resmlp": (_resmlp, "1 block, dim 32, img 32, patch 8 (Affine norms)", "selected"),
    "convnext": (_convnext, "4 stages x 1 block, dims 8-16, LayerNorm", "selected"),
    "resnet18": (_timm("resnet18"), "standard, BatchNorm (train mode)", "refused"),
}


def _rel_err(grads, ref) -> float:
    """Max over parameters of ||g - r|| / ||r||, with ||r|| floored at 1e-9 of the whole gradient's norm:
    some parameters have an exactly-zero true gradient (attention key biases, talking-heads biases under
    softmax shift invariance) and carry only rounding noise (~1e-23) on both sides."""
    total = torch.sqrt(sum(r.double().pow(2).sum() for r in ref.values())).item()
    return max((g.double() - ref[k].double()).norm().item() / max(ref[k].double().norm().item(), 1e-9 * total)
               for k, g in grads.items())


def run_zoo_model(name: str, seed: int = 0) -> dict:
    """One selected step of ``name`` (float64, aot_eager, forced KEEP) against the float64 eager reference
    of sum_i w_i l_i / N.  Returns the report row."""
    make, config, expected = ZOO[name]
    torch.manual_seed(seed)
    model = make().double()
    keep = torch.tensor(KEEP)
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: keep, backend="aot_eager")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 3, 32, 32, dtype=torch.float64, generator=g)
    y = torch.randint(0, 10, (N,), generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.zero_grad(set_to_none=True)
        F.cross_entropy(cm(x), y).backward()
    grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for k, p in model.named_parameters()}
    st = capskip_fx.stats(cm)
    w = st.weight if st.weight is not None else torch.ones(N, dtype=torch.float64)
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    (F.cross_entropy(ref(x), y, reduction="none") * w.double()).sum().div(N).backward()
    ref_grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in ref.named_parameters()}
    recs = cm.backend.records
    return {
        "model": name, "config": config, "expected": expected,
        "params": sum(p.numel() for p in model.parameters()),
        "graphs": len(recs),
        "backward": ", ".join(sorted({r.backward for r in recs})),
        "selected": [r.head for r in recs],
        "row_counts": sorted(set().union(*(r.row_counts for r in recs))),
        "coupled": any(r.coupled for r in recs),
        "reason": st.fallback,
        "kept": st.kept,
        "warnings": [str(m.message) for m in caught if "capskip_fx" in str(m.message)],
        "max_rel_err": _rel_err(grads, ref_grads),
    }


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model(name):
    row = run_zoo_model(name)
    assert row["max_rel_err"] < 1e-10, row
    if row["expected"] == "selected":
        assert row["graphs"] == 1, row
        assert row["selected"] == [True], row
        assert row["backward"] == "selected rows", row
        assert row["row_counts"] == [len(KEEP)], row
        assert row["reason"] is None, row
        assert row["kept"] == len(KEEP), row
        assert not row["warnings"], row
    else:  # BatchNorm in train mode: refused, dense, reason recorded and warned
        assert row["coupled"], row
        assert row["backward"] == "dense", row
        assert row["kept"] == N, row
        assert "cross-example" in row["reason"], row
        assert any("cross-example" in m for m in row["warnings"]), row

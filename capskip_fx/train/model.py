"""The timm model a config names, and its classifier head."""
from __future__ import annotations

import dataclasses
import warnings

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import TrainConfig

OFFLINE_HINT = ("pass --initial-checkpoint PATH (a run's checkpoint.pt, a state_dict .pt/.pth or a .safetensors "
                "file) to start from weights on disk instead")


def check_pretrained(model: str) -> None:
    """Fetch timm's pretrained weights for ``model`` now (into timm's cache), so that an offline
    machine fails before any data is loaded, with one message instead of a traceback deep in timm."""
    import timm

    if not timm.models.get_pretrained_cfg(model):
        raise SystemExit(f"--pretrained: timm has no pretrained weights for {model!r}; {OFFLINE_HINT}")
    try:
        # the meta device: timm resolves and downloads the weights, nothing is allocated
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            timm.create_model(model, pretrained=True)
    except Exception as e:  # network, hub and cache errors come in many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise SystemExit(f"--pretrained: could not fetch timm's pretrained weights for {model!r} "
                         f"({type(e).__name__}: {first[:300]}). Offline? {OFFLINE_HINT}") from None


def build_model(cfg: TrainConfig, num_classes: int, pretrained: bool = False) -> tuple[nn.Module, TrainConfig]:
    """timm model from the config (``--task lm``: a tiny transformers causal LM); returns the config with
    what was actually passed."""
    if cfg.task == "lm":
        from .text import build_lm

        return build_lm(cfg.model, cfg.seq_len, cfg.depth, cfg.embed_dim, cfg.num_heads), cfg
    import timm

    shape = {k: getattr(cfg, k) for k in ("depth", "embed_dim", "num_heads") if getattr(cfg, k) is not None}
    vit = {"img_size": cfg.img_size, "patch_size": cfg.patch_size} if cfg.patch_size else {}
    kw = dict(pretrained=pretrained, num_classes=num_classes, in_chans=cfg.in_chans, **vit, **shape,
              **cfg.model_kwargs)
    try:
        return timm.create_model(cfg.model, **kw), cfg
    except TypeError as e:
        if not vit or "unexpected keyword" not in str(e):  # CNNs etc. take no img_size/patch_size
            raise
        print(f"[model] {cfg.model} takes no img_size/patch_size ({e}); creating it without them")
        kw = {k: v for k, v in kw.items() if k not in vit}
        return timm.create_model(cfg.model, **kw), dataclasses.replace(cfg, patch_size=None)


def loss_fn(cfg: TrainConfig) -> Callable[..., torch.Tensor]:
    """``loss(logits, targets, reduction="mean")``: cross-entropy per row (classify) or the next-token loss
    (``--task lm``: the mean over every token; ``reduction="none"``: each sequence's mean)."""
    if cfg.task == "lm":
        from .text import lm_loss

        return lm_loss
    return F.cross_entropy


def find_head(model: nn.Module) -> nn.Module:
    """The classifier: timm's ``get_classifier()``, else the last nn.Linear."""
    get = getattr(model, "get_classifier", None)
    head = get() if callable(get) else None
    if isinstance(head, nn.Module) and any(True for _ in head.parameters()):
        return head
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("no classifier head found (no get_classifier() and no nn.Linear)")
    return linears[-1]

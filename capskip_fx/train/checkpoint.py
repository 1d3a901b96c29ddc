"""Checkpoints, as in timm: ``checkpoint.pt`` at each epoch end (resume), and model weights only
(``--initial-checkpoint``).

A checkpoint holds what the next epoch depends on, so that ``--resume`` continues bit-exactly:
model + rule state (``CapskipModule.state_dict()`` carries the rule's under ``_capskip``), optimizer,
step / epoch / schedule position, the compile-aware clock, the per-epoch summary rows, the run
counters, every RNG the loop draws from (torch CPU + CUDA, numpy, python ``random``, the train
sampler's generator) and the resolved config.  Only plain containers and tensors, so it loads
with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

FORMAT = 1
FILENAME = "checkpoint.pt"
_RULE_STATE_KEY = "_capskip"  # CapskipModule's key for the rule state in its state_dict


def save(obj: Any, path: str | Path) -> None:
    """``torch.save`` atomically: temp file in the same folder, flush + fsync, ``os.replace``.
    A crash leaves the previous file (or none), never a truncated one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    try:  # the rename itself is durable once the folder entry is
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _load(path: str | Path, what: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise SystemExit(f"{what} {path}: cannot read it as a torch checkpoint ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''})") from None


def load_for_resume(path: str | Path) -> dict[str, Any]:
    """A run's ``checkpoint.pt``; anything else exits with what to use instead."""
    ck = _load(path, "--resume")
    if not (isinstance(ck, dict) and ck.get("format") == FORMAT and "optimizer" in ck and "config" in ck):
        raise SystemExit(f"--resume {path}: not a capskip-train checkpoint.pt (no optimizer / config state); "
                         f"use --initial-checkpoint to start from its weights only")
    return ck


# ---------------------------------------------------------------- RNG states

def rng_state(loader_generator: Optional[torch.Generator]) -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        # numpy's state as a tensor and ints: weights_only loading refuses numpy arrays
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": random.getstate(),
        "loader": None if loader_generator is None else loader_generator.get_state(),
    }


def set_rng_state(state: dict[str, Any], loader_generator: Optional[torch.Generator]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if loader_generator is not None and state.get("loader") is not None:
        loader_generator.set_state(state["loader"])


# ---------------------------------------------------------------- weights only

def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Model weights from a run's checkpoint.pt, a plain state_dict .pt/.pth, or a .safetensors file."""
    path = Path(path)
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise SystemExit(f"--initial-checkpoint {path}: reading .safetensors needs the safetensors "
                             f"package: pip install safetensors") from None
        try:
            return load_file(str(path), device="cpu")
        except Exception as e:
            raise SystemExit(f"--initial-checkpoint {path}: cannot read it as safetensors ({e})") from None
    sd = _load(path, "--initial-checkpoint")
    for key in ("model", "state_dict"):  # ours, and the usual wrappers (timm's train.py writes state_dict)
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
            break
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for k, v in sd.items() if k != _RULE_STATE_KEY):
        raise SystemExit(f"--initial-checkpoint {path}: no state_dict (name -> tensor) found in it")
    sd = {k: v for k, v in sd.items() if k != _RULE_STATE_KEY}  # the rule's state is not a model weight
    if sd and all(k.startswith("module.") for k in sd):  # saved from DDP(model)
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def load_weights(model: nn.Module, head: nn.Module, sd: dict[str, torch.Tensor], source: str,
                 reset_head: bool = False) -> dict[str, list]:
    """Load ``sd`` into ``model`` non-strictly and print what did not match.  Head tensors whose shape
    differs (another class count), or all of them with ``reset_head``, are dropped: the head keeps its
    fresh init.  Any other shape mismatch exits: silently skipping a body weight would train from a
    half-random model."""
    own = model.state_dict()
    head_keys = {n for n, p in model.named_parameters() if any(p is q for q in head.parameters())}
    head_keys |= {n for n, b in model.named_buffers() if any(b is q for q in head.buffers())}
    reinit = sorted(k for k in sd if k in head_keys and (reset_head or tuple(sd[k].shape) != tuple(own[k].shape)))
    bad = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
           for k in sd if k in own and k not in reinit and tuple(sd[k].shape) != tuple(own[k].shape)]
    if bad:
        raise SystemExit(f"--initial-checkpoint {source}: shapes differ from the model's (different "
                         f"architecture flags?): " + "; ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""))
    res = model.load_state_dict({k: v for k, v in sd.items() if k not in reinit}, strict=False)
    missing = sorted(k for k in res.missing_keys if k not in reinit)
    report = {"missing": missing, "unexpected": sorted(res.unexpected_keys), "reinitialised": reinit}
    print(f"[init] {len(sd) - len(reinit) - len(report['unexpected'])} tensors from {source}")
    print(f"[init] missing keys ({len(missing)}): {', '.join(missing) or 'none'}")
    print(f"[init] unexpected keys ({len(report['unexpected'])}): {', '.join(report['unexpected']) or 'none'}")
    if reinit:
        why = "--reset-head" if reset_head else "class count differs"
        print(f"[init] re-initialised ({why}): {', '.join(reinit)}")
    return report

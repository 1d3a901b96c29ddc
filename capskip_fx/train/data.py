"""The harness's data plumbing: the dataset a config names, its loaders, and the resolved sizes."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.utils.data import DataLoader, RandomSampler

from capskip_fx.rules.stale_sb_filter import StaleBatchFilter, StaleBatchSampler
from .datasets import DEFAULT_IMG_SIZE, DataBundle, collate, load_dataset
from capskip_fx.rules import StaleSB

from .config import TrainConfig, uses_infobatch
from .infobatch import InfoBatchSampler


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: this machine's torch sees no CUDA device; --device cpu or auto")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise SystemExit(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def load_data(cfg: TrainConfig, device: torch.device) -> tuple[DataBundle, TrainConfig]:
    """The dataset, and the config with the sizes the data decided (image size, channels, patch)."""
    if cfg.task == "lm":
        from .text import load_pytext

        data = load_pytext(cfg.seq_len, cfg.train_subset, cfg.eval_subset, cfg.val_split)
        return data, dataclasses.replace(cfg, img_size=None, in_chans=None, patch_size=None, device=str(device))
    data = load_dataset(cfg.dataset, cfg.data_dir, img_size=cfg.img_size, in_chans=cfg.in_chans,
                        train_subset=cfg.train_subset, eval_subset=cfg.eval_subset, augment=cfg.augment,
                        val_split=cfg.val_split)
    img = cfg.img_size or DEFAULT_IMG_SIZE[cfg.dataset]
    cfg = dataclasses.replace(cfg, img_size=img, in_chans=data.in_chans,
                              patch_size=cfg.patch_size or max(1, img // 4), device=str(device))
    return data, cfg


def make_loaders(cfg: TrainConfig, data: DataBundle, device: torch.device, stale_rule: Optional[StaleSB] = None):
    """(train loader, eval loader, the train sampler's generator): checkpoints carry the generator.

    ``stale_rule``: Stale-SB's data side.  The train loader's batch sampler is then a
    :class:`StaleBatchSampler` (main process; fixed-size batches of the rows it forwards, then the
    short rest: nothing dropped), its filter drawing from that rule's cache with its own generator
    (seeded from ``cfg.seed``)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    pin = device.type == "cuda"
    # a ragged last batch would be one more shape to compile
    drop_last = len(data.train) >= cfg.batch_size
    # whole batches from ImageDataset.__getitems__, augmented as tensors (collate passes them through)
    workers = dict(num_workers=cfg.workers, pin_memory=pin, persistent_workers=cfg.workers > 0, collate_fn=collate)
    if stale_rule is not None:
        # never drops: the rows of a short last batch were planned (pre-selected, due a scoring
        # forward); the reference flushes them too.  The ragged batch is one dynamic-batch shape.
        batches = StaleBatchSampler(RandomSampler(data.train, generator=gen), StaleBatchFilter(stale_rule, cfg.seed),
                                    cfg.batch_size, drop_last=False)
        train_loader = DataLoader(data.train, batch_sampler=batches, **workers)
    elif uses_infobatch(cfg):
        ib = InfoBatchSampler(len(data.train), cfg.epochs, cfg.infobatch_ratio, cfg.infobatch_delta, seed=cfg.seed)
        train_loader = DataLoader(data.train, batch_size=cfg.batch_size, sampler=ib, drop_last=drop_last, **workers)
    else:
        train_loader = DataLoader(data.train, batch_size=cfg.batch_size, shuffle=True, generator=gen,
                                  drop_last=drop_last, **workers)
    eval_loader = DataLoader(data.test, batch_size=cfg.eval_batch_size, num_workers=cfg.workers, pin_memory=pin,
                             collate_fn=collate)
    return train_loader, eval_loader, gen

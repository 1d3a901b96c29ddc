"""Language modelling for the harness (``--task lm``): offline text, byte tokens, a tiny causal LM.

Text: the ``.py`` files of the running Python's standard library (``sysconfig``'s ``stdlib``), read in
sorted path order, as bytes (the vocabulary is the 256 byte values: no tokenizer to download).  The
stream is cut into non-overlapping windows of ``seq_len + 1`` bytes; a row is one window, ``x`` its
first ``seq_len`` bytes and ``y`` the next-byte targets.  The last 10 % of the windows are the test
split (fixed; ``val_split`` holds rows out of the training split instead).  The corpus depends on the
Python version; ``source`` names it.

Models: Hugging Face ``gpt2`` (tied embeddings) or ``llama`` at a tiny size, returning the logits
``(N, T, 256)``; the loss is the mean next-byte cross-entropy over every token of the batch
(:func:`lm_loss`), computed outside the model.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from .config import LM_MODELS
from .datasets import Batch, DataBundle, Split

VOCAB = 256
MAX_BYTES = 4_000_000  # enough windows for any subset the CLI uses; reading more only costs time


def stdlib_bytes(limit: int = MAX_BYTES) -> tuple[bytes, str]:
    """The standard library's ``.py`` sources, concatenated in sorted path order (at most ``limit`` bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        total += len(data)
        if total >= limit:
            break
    if not out:
        raise FileNotFoundError(f"pytext: no .py files under {root} (the Python standard library)")
    return b"".join(out)[:limit], f"python-stdlib:{root}"


class TokenDataset(Dataset):
    """Rows of ``seq_len + 1`` byte tokens; items are ``(x, y, index)`` with ``y`` the next tokens."""

    def __init__(self, split: Split):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int):
        w = self.split.images[i].long()
        return w[:-1], w[1:], i

    def __getitems__(self, rows: list[int]) -> Batch:
        idx = torch.as_tensor(rows, dtype=torch.int64)
        w = self.split.images[idx].long()
        return Batch((w[:, :-1], w[:, 1:], idx))


def load_pytext(seq_len: int, train_subset: Optional[int] = None, eval_subset: Optional[int] = None,
                val_split: Optional[int] = None, log=print) -> DataBundle:
    text, source = stdlib_bytes()
    n = len(text) // (seq_len + 1)
    windows = torch.frombuffer(bytearray(text[: n * (seq_len + 1)]), dtype=torch.uint8).view(n, seq_len + 1)
    n_test = n // 10
    # Split's labels are unused here (the targets are in the windows); they keep its subset/hold-out code
    train = Split(windows[: n - n_test].clone(), torch.zeros(n - n_test, dtype=torch.int64))
    test = Split(windows[n - n_test:].clone(), torch.zeros(n_test, dtype=torch.int64))
    if val_split:
        train, test = train.hold_out(val_split)
        source += f" (eval: {val_split} rows held out of train)"
    train, test = train.subset(train_subset), test.subset(eval_subset)
    log(f"[data] pytext: {len(train)} train / {len(test)} eval windows of {seq_len} byte tokens ({source})")
    return DataBundle(TokenDataset(train), TokenDataset(test), VOCAB, 1, seq_len, source)


class CausalLM(nn.Module):
    """A Hugging Face causal LM that returns its logits ``(N, T, V)`` (the loss is the harness's)."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.hf(input_ids=input_ids).logits

    def get_classifier(self) -> nn.Module:
        return self.hf.get_output_embeddings()


def build_lm(name: str, seq_len: int, depth: Optional[int], embed_dim: Optional[int],
             num_heads: Optional[int]) -> CausalLM:
    """A tiny ``gpt2`` or ``llama`` from ``transformers`` (no weights downloaded), dropout off."""
    import transformers

    d, layers, heads = embed_dim or 64, depth or 2, num_heads or 2
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=seq_len, n_embd=d, n_layer=layers, n_head=heads,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        hf = transformers.GPT2LMHeadModel(cfg)
    elif name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=d, intermediate_size=2 * d,
                                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                       max_position_embeddings=seq_len, tie_word_embeddings=False)
        hf = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"--task lm: model {name!r} not in {LM_MODELS}")
    return CausalLM(hf)


def lm_loss(z: Tensor, y: Tensor, reduction: str = "mean") -> Tensor:
    """Next-token cross-entropy of logits ``(N, T, V)``: the mean over every token of the batch, or
    (``reduction="none"``) each sequence's mean over its tokens, ``(N,)``."""
    flat = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction="mean" if reduction == "mean" else "none")
    return flat if reduction == "mean" else flat.view(y.shape).mean(1) if reduction == "none" else flat.sum()

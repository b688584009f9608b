"""Text for language modelling: a file, a directory or the bundled corpus, cut into token blocks.

A sample is ``(x, y)``: ``x`` is ``block_size`` token ids and ``y`` the same window one
token later (targets shifted here, so the loss is plain token cross-entropy of the
logits at ``t`` against ``y[t]``, with nothing to shift in the model or the loop).
Blocks do not overlap. The test set is the last ``test_fraction`` of the token
stream, in one piece, so that no text of it appears in training.

Tokens are UTF-8 bytes by default (a vocabulary of 256, nothing to install or
download); a Hugging Face tokenizer is used by name when ``transformers`` is
installed and the tokenizer is already in the local cache. Nothing downloads.
"""

from __future__ import annotations

import os
from importlib import resources
from typing import Any

import torch
from torch.utils.data import TensorDataset

from ..errors import UsageError, first_line

#: the bundled corpus: prose from the docstrings of Python's standard library (corpus/README)
CORPUS = "python_docstrings.txt"
#: what a directory contributes, every file under it with one of these endings
TEXT_SUFFIXES = (".txt", ".md")


class TextBlocks(TensorDataset):
    """``TensorDataset(x [N, block], y [N, block])`` of int64 token ids that says how they
    were made: ``vocab_size`` (what `num_classes` reports, the model's output width) and
    ``tokenizer_name`` (``"bytes"`` or the Hugging Face name), so that ids can be turned
    back into text with `decode`."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, vocab_size: int, tokenizer_name: str) -> None:
        super().__init__(x, y)
        self.vocab_size = vocab_size
        self.tokenizer_name = tokenizer_name

    def decode(self, ids: Any) -> str:
        """The text of token ids (a 1-D tensor or list), as this dataset's tokenizer reads them."""
        if self.tokenizer_name == "bytes":
            return decode_bytes(ids)
        return _hf_tokenizer(self.tokenizer_name).decode(torch.as_tensor(ids).tolist())


def byte_tokens(text: str) -> torch.Tensor:
    """The UTF-8 bytes of ``text`` as int64 token ids (vocabulary 256)."""
    data = text.encode("utf-8")
    if not data:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def decode_bytes(ids: Any) -> str:
    """Text from byte token ids; a block cut inside a multi-byte character shows U+FFFD there."""
    t = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) > 255):
        raise UsageError(f"Expected byte token ids in [0, 256). Received: ids in [{int(t.min())}, {int(t.max())}]")
    return bytes(t.tolist()).decode("utf-8", errors="replace")


def load_text(path: str | None, block_size: int = 256, tokenizer: str | None = None, test_fraction: float = 0.1,
              seed: int = 0) -> tuple[TextBlocks, TextBlocks]:
    """``(train, test)`` blocks of the text at ``path`` (a UTF-8 file, or a directory: its
    ``*.txt`` and ``*.md`` files, sorted by path, joined by a blank line); None reads the
    bundled corpus. ``tokenizer`` names a cached Hugging Face tokenizer (default: bytes).

    ``seed`` is accepted as every loader's is; the split is by position, so it does not
    depend on it. Raises `UsageError`, one line, for a missing or non-UTF-8 file, an
    uncached tokenizer, or text too short for one train and one test block.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise UsageError(f"Expected a positive block_size for text data. Received: block_size={block_size!r}")
    if not 0.0 <= test_fraction < 1.0:
        raise UsageError(f"Expected a test_fraction in [0, 1) for text data. Received: test_fraction={test_fraction!r}")
    text = read_text(path)
    if tokenizer is None:
        tokens, vocab_size, name = byte_tokens(text), 256, "bytes"
    else:
        tok = _hf_tokenizer(tokenizer)
        ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]  # verbose: no max-length warning
        tokens, vocab_size, name = torch.tensor(ids, dtype=torch.int64), len(tok), tokenizer
    n_test = int(round(len(tokens) * test_fraction))
    train_tokens, test_tokens = tokens[:len(tokens) - n_test], tokens[len(tokens) - n_test:]
    span = block_size + 1
    if len(train_tokens) < span or (test_fraction > 0 and len(test_tokens) < span):
        where = "the bundled corpus" if path is None else repr(path)
        raise UsageError(f"Expected text for at least one train and one test block of block_size+1 = {span} tokens "
                         f"in {where}. Received: {len(tokens)} tokens, {len(train_tokens)} train and {len(test_tokens)} "
                         f"test at test_fraction={test_fraction}")
    return _blocks(train_tokens, block_size, vocab_size, name), _blocks(test_tokens, block_size, vocab_size, name)


def _blocks(tokens: torch.Tensor, block_size: int, vocab_size: int, name: str) -> TextBlocks:
    """Non-overlapping chunks of ``block_size + 1`` tokens, each split into input and shifted target."""
    n = len(tokens) // (block_size + 1)
    chunks = tokens[:n * (block_size + 1)].view(n, block_size + 1)
    return TextBlocks(chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous(), vocab_size, name)


def read_text(path: str | None) -> str:
    """The text of a UTF-8 file, of every ``*.txt``/``*.md`` file under a directory (sorted by
    path, joined by a blank line), or of the bundled corpus (None)."""
    if path is None:
        return resources.files(__package__).joinpath("corpus").joinpath(CORPUS).read_text(encoding="utf-8")
    if os.path.isdir(path):
        files = sorted(
            os.path.join(root, f) for root, _, names in os.walk(path) for f in names if f.endswith(TEXT_SUFFIXES)
        )
        if not files:
            raise UsageError(f"Expected *.txt or *.md files under the directory {path!r}. Received: none")
        return "\n\n".join(_read_file(f) for f in files)
    if not os.path.exists(path):
        raise UsageError(f"Expected an existing text file or directory. Received: {path!r} (no such file)")
    return _read_file(path)


def _read_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise UsageError(f"Expected UTF-8 text in {path!r}. Received: {first_line(exc)}") from None
    except OSError as exc:
        raise UsageError(f"Expected a readable text file {path!r}. Received: {type(exc).__name__}: "
                         f"{first_line(exc)}") from None


def _hf_tokenizer(name: str) -> Any:
    """``transformers.AutoTokenizer.from_pretrained(name)`` from the local cache only: a run
    never downloads, and a tokenizer that is not there is one line saying so."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError(f"Expected the Python package transformers for tokenizer {name!r}. Received: transformers is "
                         f"not installed (pip install transformers, or leave the tokenizer out to use bytes)") from None
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UsageError(f"Expected tokenizer {name!r} in the local Hugging Face cache (partrain downloads nothing). "
                         f"Received: not cached ({type(exc).__name__}: {first_line(exc)})") from None

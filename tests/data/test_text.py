"""Text data for language modelling (partrain.data.text): what a GPT run trains and tests on.

The contract a training loop relies on: samples are ``(x, y)`` int64 blocks with ``y``
already shifted by one token, the test set is the tail of the text (none of it seen
in training), and `num_classes` reports the vocabulary, not the largest id seen.
Bad input is one line; nothing downloads (a tokenizer comes from the local cache).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.utils.data import Subset

from partrain.data.datasets import DataSpec, load_dataset, num_classes, sample_shape
from partrain.data.text import byte_tokens, decode_bytes, load_text
from partrain.errors import UsageError

TEXT = "Hello, wörld! Ünïcode ✓ and plain ASCII. " * 20


def test_bytes_round_trip_and_cover_256_ids():
    ids = byte_tokens(TEXT)
    assert ids.dtype == torch.int64 and len(ids) == len(TEXT.encode("utf-8"))
    assert decode_bytes(ids) == TEXT
    assert decode_bytes(ids.tolist()) == TEXT
    assert decode_bytes(byte_tokens("✓")[:2]) == "\ufffd"  # a block cut inside a character
    assert byte_tokens("").shape == (0,)


def test_blocks_do_not_overlap_and_targets_are_shifted(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(TEXT, encoding="utf-8")
    train, test = load_text(str(path), block_size=16, test_fraction=0.25)
    x, y = train.tensors
    assert x.shape == y.shape and x.shape[1] == 16 and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    tokens = byte_tokens(TEXT)
    n_train = len(tokens) - round(len(tokens) * 0.25)
    assert len(train) == n_train // 17
    for i in range(len(train)):  # chunk i is tokens[17 i : 17 (i + 1)]
        assert torch.equal(x[i], tokens[17 * i:17 * i + 16])
        assert int(y[i, -1]) == int(tokens[17 * i + 16])
    assert train.vocab_size == test.vocab_size == 256 and train.tokenizer_name == "bytes"
    assert train.decode(x[0]) == decode_bytes(x[0])


def test_the_test_set_is_the_tail_of_the_text(tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    path = tmp_path / "letters.txt"
    path.write_text(text, encoding="utf-8")
    train, test = load_text(str(path), block_size=9, test_fraction=0.2)
    tokens = byte_tokens(text)
    tail = tokens[800:]
    assert torch.equal(test.tensors[0][0], tail[:9])  # the test set starts where training's text ends
    assert len(test) == 200 // 10 and len(train) == 800 // 10
    last_train = int(train.tensors[1][-1, -1])
    assert last_train == int(tokens[799])  # train ends within the first 800 tokens


def test_a_directory_reads_its_text_files_sorted(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.md").write_text("second " * 30, encoding="utf-8")
    (tmp_path / "1.txt").write_text("first " * 30, encoding="utf-8")
    (tmp_path / "skip.bin").write_bytes(b"\xff\xfe not text")
    train, test = load_text(str(tmp_path), block_size=8, test_fraction=0.3)
    tokens = byte_tokens("first " * 30 + "\n\n" + "second " * 30)  # 1.txt, then b/2.md
    n_train = len(tokens) - round(len(tokens) * 0.3)
    assert torch.equal(train.tensors[0][0], tokens[:8])
    assert torch.equal(test.tensors[0][0], tokens[n_train:n_train + 8])


def test_the_bundled_corpus_loads_by_name():
    train, test = load_dataset(DataSpec(name="text", block_size=64))
    assert sample_shape(train) == (64,)
    assert num_classes(train) == 256 and num_classes(Subset(train, [0, 1])) == 256
    assert len(train) > 1000 and len(test) > 100
    words = decode_bytes(train.tensors[0][:20].reshape(-1))
    assert " the " in words


def test_text_path_by_name_and_bad_input_are_one_line(tmp_path):
    path = tmp_path / "notes.csv"  # text: wins over the .csv suffix
    path.write_text(TEXT, encoding="utf-8")
    train, _ = load_dataset(DataSpec(name=f"text:{path}", block_size=8))
    assert sample_shape(train) == (8,)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café ".encode("latin-1") * 50)
    cases = {
        f"text:{bad}": f"Expected UTF-8 text in '{bad}'. Received: ",
        f"text:{tmp_path}/missing.txt": "Expected an existing text file or directory. Received: ",
        f"text:{tmp_path / 'empty'}": "Expected *.txt or *.md files under the directory",
    }
    (tmp_path / "empty").mkdir()
    for name, start in cases.items():
        with pytest.raises(UsageError) as info:
            load_dataset(DataSpec(name=name))
        assert str(info.value).startswith(start) and "\n" not in str(info.value)


def test_too_little_text_is_one_line_with_the_counts(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x" * 40, encoding="utf-8")
    with pytest.raises(UsageError) as info:
        load_text(str(path), block_size=16, test_fraction=0.25)
    assert str(info.value) == (
        f"Expected text for at least one train and one test block of block_size+1 = 17 tokens in '{path}'. "
        "Received: 40 tokens, 30 train and 10 test at test_fraction=0.25")


def test_a_tokenizer_that_is_not_there_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    path.write_text(TEXT, encoding="utf-8")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(UsageError) as info:
        load_text(str(path), tokenizer="gpt2")
    assert "transformers is not installed" in str(info.value) and "\n" not in str(info.value)

    def from_pretrained(name, local_files_only):
        assert local_files_only  # never a download
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}.\nCheck your connection.")

    fake = types.ModuleType("transformers")
    fake.AutoTokenizer = types.SimpleNamespace(from_pretrained=from_pretrained)
    monkeypatch.setitem(sys.modules, "transformers", fake)
    with pytest.raises(UsageError) as info:
        load_text(str(path), tokenizer="gpt2")
    assert "Expected tokenizer 'gpt2' in the local Hugging Face cache" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_cached_tokenizer_sets_the_vocabulary(tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    path.write_text(TEXT, encoding="utf-8")

    class Words:  # stands in for a Hugging Face tokenizer: one id per distinct word
        def __init__(self):
            self.vocab = {w: i for i, w in enumerate(sorted(set(TEXT.split())))}

        def __len__(self):
            return len(self.vocab) + 3

        def __call__(self, text, add_special_tokens, verbose):
            return {"input_ids": [self.vocab[w] for w in text.split()]}

    fake = types.ModuleType("transformers")
    fake.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda name, local_files_only: Words())
    monkeypatch.setitem(sys.modules, "transformers", fake)
    train, test = load_dataset(DataSpec(name=f"text:{path}", block_size=4, tokenizer="words", test_fraction=0.2))
    assert num_classes(train) == len(Words()) and train.tokenizer_name == "words"
    assert torch.equal(train.tensors[1][:, :-1], train.tensors[0][:, 1:])


def test_a_tokenizer_with_other_data_is_one_line():
    with pytest.raises(UsageError) as info:
        load_dataset(DataSpec(name="digits", tokenizer="gpt2"))
    assert "Expected a tokenizer with a text dataset" in str(info.value)


def test_a_real_hugging_face_tokenizer_saved_locally_tokenizes_and_decodes(tmp_path):
    # a tokenizer built here and saved as a directory: the real transformers path, nothing downloaded
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    text = "the quick brown fox jumps over the lazy dog. " * 200
    source = tmp_path / "words.txt"
    source.write_text(text)
    core = Tokenizer(models.BPE(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    saved = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(saved)
    train, test = load_text(str(source), block_size=8, tokenizer=str(saved), test_fraction=0.1)
    vocabulary = len(AutoTokenizer.from_pretrained(saved, local_files_only=True))
    assert train.tokenizer_name == str(saved) and train.vocab_size == num_classes(train) == vocabulary > 256
    assert int(train.tensors[0].max()) < train.vocab_size
    ids = AutoTokenizer.from_pretrained(saved, local_files_only=True)("quick brown fox")["input_ids"]
    assert len(ids) < len("quick brown fox")  # merged: not one token per byte
    assert train.decode(ids) == "quick brown fox"
    first = torch.cat([train.tensors[0][0], train.tensors[1][0][-1:]])  # a block's inputs and its last target
    assert text.startswith(train.decode(first))

"""Variable-length samples: padding to a common shape, masks, packed sequences, a padding collate.

One padding rule for the project: `pad_cat` pads every tensor's trailing dimensions up to
the largest among them (at the end, with ``pad_value``) and concatenates along dim 0.
Training batches variable-length samples with it (`PadCollate`), and the serving batcher
(`partrain.batching.stack_batch`) batches requests of different shapes with it.

A padded batch travels as a dict, so `fit` calls the model as ``model(x=..., lengths=...)``
(and ``mask=...`` with ``PadCollate(mask=True)``): a model takes the lengths to ignore
the padding, e.g. through `pack` for an RNN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from ..errors import UsageError


def pad_cat(parts: Sequence[Tensor], pad_value: float = 0.0) -> Tensor:
    """``parts`` (each ``(rows, ...)``) concatenated along dim 0, trailing dims padded at their end
    to the largest size among the parts."""
    if not parts:
        raise UsageError("Expected at least one tensor to pad and concatenate. Received: none")
    target = [max(s) for s in zip(*(t.shape[1:] for t in parts))] if parts[0].dim() > 1 else []
    padded = []
    for t in parts:
        if list(t.shape[1:]) != target:
            widths: list[int] = []
            for have, want in zip(reversed(t.shape[1:]), reversed(target)):
                widths += [0, want - have]
            t = torch.nn.functional.pad(t, widths, value=pad_value)
        padded.append(t)
    return padded[0] if len(padded) == 1 else torch.cat(padded, 0)


def pad_sequences(sequences: Sequence[Tensor], pad_value: float = 0.0) -> tuple[Tensor, Tensor]:
    """Samples shaped ``(length, ...)`` as one ``(batch, max_length, ...)`` tensor and their lengths."""
    if any(s.dim() == 0 for s in sequences):
        raise UsageError("Expected sequences shaped (length, ...). Received: a 0-d tensor")
    lengths = torch.tensor([int(s.shape[0]) for s in sequences], dtype=torch.int64)
    return pad_cat([s.unsqueeze(0) for s in sequences], pad_value), lengths


def mask_of(lengths: Tensor, max_length: int | None = None) -> Tensor:
    """``(batch, max_length)`` booleans: True at real steps, False at padding."""
    steps = int(lengths.max()) if max_length is None and len(lengths) else (max_length or 0)
    return torch.arange(steps, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def pack(x: Tensor, lengths: Tensor) -> torch.nn.utils.rnn.PackedSequence:
    """A padded ``(batch, time, ...)`` batch as a packed sequence for an RNN (padding skipped)."""
    return torch.nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)


def padding_fraction(lengths: Tensor, batches: Sequence[Tensor]) -> float:
    """Share of padded steps over all steps of ``batches`` (index tensors into ``lengths``)."""
    padded = real = 0
    for index in batches:
        if len(index):
            chosen = lengths[index]
            padded += int(chosen.max()) * len(index)
            real += int(chosen.sum())
    return (padded - real) / padded if padded else 0.0


class PadCollate:
    """Collate ``(sequence, target)`` samples into ``{"x", "lengths", ["mask"], "y"}``.

    Sequences are shaped ``(length, ...)``; targets are stacked (equal shapes). Picklable,
    so it crosses to loader processes and workers.
    """

    def __init__(self, mask: bool = False, pad_value: float = 0.0) -> None:
        self.mask, self.pad_value = mask, pad_value

    def __call__(self, samples: list[Any]) -> dict[str, Tensor]:
        if not samples or not all(isinstance(s, (tuple, list)) and len(s) == 2 for s in samples):
            raise UsageError("Expected (sequence, target) samples to pad. Received: "
                             f"{type(samples[0]).__name__ if samples else 'no samples'}")
        x, lengths = pad_sequences([torch.as_tensor(s[0]) for s in samples], self.pad_value)
        batch = {"x": x, "lengths": lengths}
        if self.mask:
            batch["mask"] = mask_of(lengths, x.shape[1])
        batch["y"] = torch.stack([torch.as_tensor(s[1]) for s in samples])
        return batch


pad_collate = PadCollate()

#: a target position that counts in no loss or metric (`partrain.train.task.IGNORE_INDEX`)
IGNORE_INDEX = -100


class TokenCollate:
    """Collate token sequences for a language model: ``{"input_ids", "attention_mask", "labels"}``
    padded on the right to the batch's longest (ids with ``pad_id``, the mask 0 and the labels
    -100 there, so that padding counts in no loss and no metric).

    A sample is ``ids`` (the labels are the ids: the loss shifts them, ``causal_lm`` or a Hugging
    Face model's own) or ``(ids, labels)`` of equal length (labels already aligned with the
    logits, e.g. shifted by one: ``cross_entropy``). Both the built-in ``gpt`` and Hugging Face
    models take ``input_ids`` and ``attention_mask``; the target is found under ``labels``.
    """

    def __init__(self, pad_id: int = 0) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: list[Any]) -> dict[str, Tensor]:
        pairs = [(torch.as_tensor(s[0]), torch.as_tensor(s[1])) if isinstance(s, (tuple, list)) and len(s) == 2
                 else (torch.as_tensor(s), torch.as_tensor(s)) for s in samples]
        if not pairs or any(ids.dim() != 1 or ids.shape != labels.shape for ids, labels in pairs):
            raise UsageError("Expected token samples as ids [T] or (ids [T], labels [T]). Received: "
                             f"{[tuple(ids.shape) for ids, _ in pairs[:3]] or 'no samples'}")
        ids, lengths = pad_sequences([ids.long() for ids, _ in pairs], self.pad_id)
        labels, _ = pad_sequences([labels.long() for _, labels in pairs], IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": mask_of(lengths, ids.shape[1]).long(), "labels": labels}


class Sequences(Dataset):
    """Variable-length samples in memory: ``(sequences[i], targets[i])``, with their ``lengths``.

    ``lengths`` is what `BucketBatchSampler` (and `fit`, which buckets such a training set)
    groups by.
    """

    def __init__(self, sequences: Sequence[Tensor], targets: Sequence[Any] | Tensor) -> None:
        if len(sequences) != len(targets):
            raise UsageError(f"Expected as many targets as sequences. Received: {len(sequences)} sequences, "
                             f"{len(targets)} targets")
        if any(not isinstance(s, Tensor) or s.dim() == 0 for s in sequences):
            raise UsageError("Expected every sequence to be a tensor shaped (length, ...). Received: another")
        self.sequences = list(sequences)
        self.targets = targets
        self.lengths = torch.tensor([int(s.shape[0]) for s in self.sequences], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> tuple[Tensor, Any]:
        return self.sequences[i], self.targets[i]


__all__ = ["PadCollate", "Sequences", "TokenCollate", "mask_of", "pack", "pad_cat", "pad_collate", "pad_sequences",
           "padding_fraction"]

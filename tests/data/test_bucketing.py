"""Length bucketing and padding: every sample once per epoch, little padding, padding that changes nothing.

The references: the plain sampler's guarantees (every sample once across replicas, workers
in step, global batch sizes), the padding of random batches, a hand-padded tensor, and an
LSTM run on each sequence alone (packing must make the padding invisible to it).
"""

from __future__ import annotations

import torch

from partrain.data import BucketBatchSampler, PadCollate, Sequences, mask_of, pack, pad_cat
from partrain.data.padding import padding_fraction
from partrain.data.sharding import ShardedBatchSampler


def _lengths(n: int = 1001, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 201, (n,), generator=torch.Generator().manual_seed(seed))


def test_bucketed_batches_cover_every_sample_once_across_workers_in_step():
    lengths = _lengths()
    for epoch in (0, 1):
        ranks = [BucketBatchSampler(lengths, 8, rank, 2, seed=3) for rank in (0, 1)]
        for s in ranks:
            s.set_epoch(epoch)
        batches = [list(s) for s in ranks]
        assert len(batches[0]) == len(batches[1]) == len(ranks[0])  # workers take the same steps
        seen = sorted(i for worker in batches for batch in worker for i in batch)
        assert seen == list(range(len(lengths)))
        for step, (a, b) in enumerate(zip(*batches)):  # global batch sizes as the loop normalises by
            assert len(a) + len(b) == ranks[0].global_batch_size(step)
    again = BucketBatchSampler(lengths, 8, 0, 2, seed=3)
    again.set_epoch(1)
    assert list(again) == batches[0]  # the same order for the same seed and epoch
    assert list(again) != list(BucketBatchSampler(lengths, 8, 0, 2, seed=3))  # another per epoch


def test_bucketing_keeps_padding_under_a_fifth_of_random_batching():
    lengths = _lengths()
    bucketed = padding_fraction(lengths, list(BucketBatchSampler(lengths, 16, 0, 1, seed=1).iter_tensors()))
    random = padding_fraction(lengths, list(ShardedBatchSampler(len(lengths), 16, 0, 1, seed=1).iter_tensors()))
    assert random > 0.4  # uniform lengths 1..200 in batches of 16: about 47% padding
    assert bucketed <= 0.2 * random


def test_pad_cat_pads_trailing_dims_at_their_end():
    a, b = torch.ones(1, 2, 3), torch.full((2, 1, 4), 2.0)
    out = pad_cat([a, b], pad_value=-1.0)
    expected = torch.full((3, 2, 4), -1.0)
    expected[0, :2, :3] = 1.0
    expected[1:, :1, :4] = 2.0
    assert torch.equal(out, expected)


def test_pad_collate_and_pack_make_padding_invisible_to_an_lstm():
    torch.manual_seed(0)
    seqs = [torch.randn(n, 3, dtype=torch.float64) for n in (5, 2, 7)]
    ds = Sequences(seqs, torch.tensor([0, 1, 0]))
    batch = PadCollate(mask=True)([ds[i] for i in range(3)])
    assert batch["x"].shape == (3, 7, 3) and batch["lengths"].tolist() == [5, 2, 7]
    assert torch.equal(batch["mask"], mask_of(torch.tensor([5, 2, 7])))
    assert batch["mask"].sum().item() == 14 and batch["y"].tolist() == [0, 1, 0]
    lstm = torch.nn.LSTM(3, 4, batch_first=True).double()
    _, (h, _) = lstm(pack(batch["x"], batch["lengths"]))
    for i, seq in enumerate(seqs):  # the reference: each sequence alone, no padding at all
        _, (alone, _) = lstm(seq.unsqueeze(0))
        torch.testing.assert_close(h[0, i], alone[0, 0], atol=1e-12, rtol=0)
    assert ds.lengths.tolist() == [5, 2, 7]

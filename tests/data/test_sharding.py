"""Sharding: every sample exactly once per epoch across workers, same step count everywhere.

The allreduce equivalence tests rely on the property checked last: the workers'
batches of step i, concatenated, are the single-process batch i.
"""

import pytest
import torch

from partrain.data.sharding import ShardedBatchSampler
from partrain.errors import UsageError


@pytest.mark.parametrize("n,batch,world", [(1797, 32, 2), (100, 7, 3), (10, 4, 4), (5, 2, 3), (64, 8, 2)])
def test_every_sample_exactly_once_per_epoch(n, batch, world):
    for epoch in range(3):
        samplers = [ShardedBatchSampler(n, batch, r, world, seed=1) for r in range(world)]
        for s in samplers:
            s.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        assert len({len(b) for b in per_rank}) == 1, "every worker must take the same number of steps"
        seen = [i for batches in per_rank for b in batches for i in b]
        assert sorted(seen) == list(range(n))
        for step in range(len(samplers[0])):
            assert sum(len(per_rank[r][step]) for r in range(world)) == samplers[0].global_batch_size(step)


def test_reshuffled_per_epoch_and_seed():
    s = ShardedBatchSampler(100, 10, 0, 2, seed=0)
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first
    s.set_epoch(0)
    assert list(s) == first
    assert list(ShardedBatchSampler(100, 10, 0, 2, seed=1)) != first


def test_drop_last_drops_only_the_incomplete_global_batch():
    s = [ShardedBatchSampler(45, 10, r, 2, drop_last=True) for r in range(2)]
    seen = sorted(i for x in s for b in x for i in b)
    assert len(seen) == 40 and len(set(seen)) == 40


def test_concatenated_worker_batches_are_the_single_process_batches():
    world, batch = 3, 5
    single = list(ShardedBatchSampler(53, batch * world, 0, 1, seed=4))
    workers = [list(ShardedBatchSampler(53, batch, r, world, seed=4)) for r in range(world)]
    for step, expected in enumerate(single):
        assert sum((w[step] for w in workers), []) == expected


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(UsageError, match="batch_size=0"):
        ShardedBatchSampler(10, 0)
    with pytest.raises(UsageError, match="rank=2"):
        ShardedBatchSampler(10, 2, 2, 2)
    assert torch.is_tensor(ShardedBatchSampler(10, 2).order())


def test_claimed_batches_cover_every_sample_once_whoever_claims():
    """Asynchronous strategies: workers claim batches from one counter, in any interleaving."""
    import itertools

    import torch.distributed as dist

    from partrain.data.sharding import ClaimingBatchSampler

    store = dist.HashStore()
    samplers = [ClaimingBatchSampler(103, 8, r, 3, store=store, key="k", seed=2) for r in range(3)]
    for epoch in range(2):
        its = [s for s in samplers]
        for s in its:
            s.set_epoch(epoch)
        streams = [s.iter_tensors() for s in its]
        seen, counts = [], [0, 0, 0]
        live = [0, 1, 2]
        pattern = itertools.cycle([0, 0, 0, 1, 2] if epoch == 0 else [2, 1, 0, 0, 0])
        while live:
            r = next(pattern)  # worker 0 is three times as fast
            if r not in live:
                continue
            batch = next(streams[r], None)
            if batch is None:
                live.remove(r)
                continue
            seen += batch.tolist()
            counts[r] += 1
        assert sorted(seen) == list(range(103))
        assert counts[0] > counts[1] and counts[0] > counts[2]


@pytest.mark.parametrize("n,epoch,batch,world", [(100, 30, 4, 2), (100, 250, 8, 3), (64, 64, 8, 2), (10, 7, 3, 1)])
def test_short_epochs_walk_on_through_the_passes_over_the_data(n, epoch, batch, world):
    """samples_per_epoch: epoch e is samples [e N, (e + 1) N) of the shuffled passes laid end to end."""
    seed = 3
    # the reference: every pass a permutation seeded as a plain epoch, concatenated, then cut
    passes = torch.cat([torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + p))
                        for p in range(6 * epoch // n + 2)])
    for e in range(5):
        samplers = [ShardedBatchSampler(epoch, batch, r, world, seed=seed, dataset_size=n) for r in range(world)]
        for s in samplers:
            s.set_epoch(e)
        want = passes[e * epoch:(e + 1) * epoch]
        assert torch.equal(samplers[0].order(), want)
        # the workers' batches still hold each of the epoch's positions once, in equal step counts
        per_rank = [list(s) for s in samplers]
        assert len({len(b) for b in per_rank}) == 1
        assert sorted(i for b in per_rank for x in b for i in x) == sorted(want.tolist())
    # an epoch as long as the data is the plain epoch; unshuffled passes are 0..n-1 over and over
    plain = ShardedBatchSampler(n, batch, 0, world, seed=seed)
    plain.set_epoch(2)
    same = ShardedBatchSampler(n, batch, 0, world, seed=seed, dataset_size=n)
    same.set_epoch(2)
    assert list(plain) == list(same)
    ordered = ShardedBatchSampler(epoch, batch, 0, 1, shuffle=False, dataset_size=n)
    ordered.set_epoch(1)
    assert ordered.order().tolist() == [(epoch + i) % n for i in range(epoch)]


def test_short_epochs_of_claimed_and_bucketed_batches():
    import torch.distributed as dist

    from partrain.data.bucketing import BucketBatchSampler
    from partrain.data.sharding import ClaimingBatchSampler

    store = dist.HashStore()
    claimed = [ClaimingBatchSampler(40, 8, r, 2, store=store, key="k", seed=1, dataset_size=100) for r in range(2)]
    for e in range(3):
        reference = ShardedBatchSampler(40, 8, 0, 1, seed=1, dataset_size=100)
        reference.set_epoch(e)
        for s in claimed:
            s.set_epoch(e)
        seen = [i for s in claimed for b in s for i in b]
        assert sorted(seen) == sorted(reference.order().tolist())
    lengths = torch.arange(100) % 17
    bucketed = BucketBatchSampler(lengths, 4, seed=1, samples_per_epoch=40, pool=2)
    reference = ShardedBatchSampler(40, 4, seed=1, dataset_size=100)
    for e in range(3):
        bucketed.set_epoch(e)
        reference.set_epoch(e)
        assert len(bucketed) == 10 and sorted(bucketed.order().tolist()) == sorted(reference.order().tolist())
    with pytest.raises(UsageError, match="Received: 0 samples"):
        ShardedBatchSampler(10, 2, dataset_size=0)

"""``zeta_fsdp.data`` pure logic, in-process: custom samplers keep their meaning when split by rank, and a
``ResumableLoader`` that could never yield a batch is refused (issue 29, items 2 and 7)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from zeta_fsdp.data import RankSlicedSampler, ResumableLoader, shard_dataloader

WORLD = 2


class Indexed(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def rank_samples(loader: DataLoader, epoch: int = 0) -> list[list[int]]:
    """What each of WORLD ranks reads from ``loader`` after ``shard_dataloader`` at ``epoch``."""
    parts = []
    for r in range(WORLD):
        torch.manual_seed(100 + r)  # ranks' global RNGs differ: the split must not depend on them
        sharded, sampler = shard_dataloader(loader, rank=r, world_size=WORLD, epoch=epoch)
        assert sampler is sharded.sampler
        parts.append([int(i) for batch in sharded for i in batch])
    return parts


def test_subset_random_sampler_trains_only_on_its_subset():
    train_idx = list(range(0, 20, 2))  # the train half of a train/validation split
    loader = DataLoader(Indexed(20), batch_size=2, sampler=SubsetRandomSampler(train_idx))
    parts = rank_samples(loader)
    assert isinstance(shard_dataloader(loader, rank=0, world_size=WORLD)[1], RankSlicedSampler)
    assert sorted(parts[0] + parts[1]) == train_idx, parts  # disjoint, complete, only the subset
    assert len(parts[0]) == len(parts[1]) == 5
    assert rank_samples(loader, epoch=0) == parts  # deterministic per epoch
    assert rank_samples(loader, epoch=1) != parts  # reshuffled by epoch


def test_weighted_random_sampler_keeps_its_weights():
    weights = [0.0] * 10 + [1.0] * 2  # only samples 10 and 11 may be drawn
    loader = DataLoader(Indexed(12), batch_size=4, sampler=WeightedRandomSampler(weights, 400, replacement=True))
    parts = rank_samples(loader)
    assert len(parts[0]) == len(parts[1]) == 200
    drawn = Counter(parts[0] + parts[1])
    assert set(drawn) == {10, 11}, drawn
    assert min(drawn.values()) > 150, drawn  # about half each, not one value repeated


def test_custom_sampler_with_its_own_generator_is_left_as_it_was():
    generator = torch.Generator().manual_seed(7)
    state = generator.get_state()
    sampler = SubsetRandomSampler([3, 4, 5, 6, 7], generator=generator)
    parts = rank_samples(DataLoader(Indexed(10), batch_size=1, sampler=sampler))
    assert sorted(set(parts[0] + parts[1])) == [3, 4, 5, 6, 7]
    assert len(parts[0]) == len(parts[1]) == 3  # 5 samples padded to 6: equal steps on every rank
    assert sampler.generator is generator and torch.equal(generator.get_state(), state)


def test_uneven_custom_sampler_drop_last_gives_equal_shares():
    class Reversed(Sampler):
        def __iter__(self):
            return iter(range(8, -1, -1))

        def __len__(self):
            return 9

    parts = rank_samples(DataLoader(Indexed(9), batch_size=1, sampler=Reversed(), drop_last=True))
    assert parts == [[8, 6, 4, 2], [7, 5, 3, 1]], parts


def test_plain_loaders_still_get_a_distributed_sampler():
    for loader in (DataLoader(Indexed(8), batch_size=2), DataLoader(Indexed(8), batch_size=2, shuffle=True)):
        sharded, sampler = shard_dataloader(loader, rank=1, world_size=WORLD)
        assert isinstance(sampler, DistributedSampler) and sharded.sampler is sampler
    assert isinstance(DataLoader(Indexed(8)).sampler, SequentialSampler)
    assert [int(i) for b in shard_dataloader(DataLoader(Indexed(8)), rank=1, world_size=2)[0] for i in b] == [
        1,
        3,
        5,
        7,
    ]


def test_random_sampler_with_replacement_is_wrapped_not_replaced():
    loader = DataLoader(Indexed(4), batch_size=5, sampler=torch.utils.data.RandomSampler(range(4), True, 10))
    sharded, sampler = shard_dataloader(loader, rank=0, world_size=WORLD)
    assert isinstance(sampler, RankSlicedSampler) and len(list(sharded)[0]) == 5  # 10 draws, 5 per rank


def test_resumable_loader_refuses_a_dataset_smaller_than_one_global_batch():
    with pytest.raises(ValueError, match=r"6 samples, fewer than one global batch \(global_batch_size=8\)"):
        ResumableLoader(list(range(6)), global_batch_size=8, rank=0, world_size=2)
    loader = ResumableLoader(list(range(8)), global_batch_size=8, rank=1, world_size=2, shuffle=False)
    assert [b.tolist() for b in loader] == [[4, 5, 6, 7]]

"""Data for data-parallel ranks: ``shard_dataloader`` splits a ``DataLoader`` by rank (what
``FSDP2Strategy.process_dataloader`` does); ``ResumableLoader`` resumes exactly, at any world size."""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterator, Mapping, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from .distributed import expected_world_size, get_rank, is_distributed

__all__ = ["RankSlicedSampler", "ResumableLoader", "shard_dataloader"]


class RankSlicedSampler(Sampler):
    """Rank ``rank``'s disjoint share of any sampler's order: what ``shard_dataloader`` wraps a custom sampler in.

    Each epoch the wrapped sampler is iterated once with its randomness seeded by ``seed + epoch``
    (its own ``generator`` swapped for a seeded one for that one pass, or torch's global RNG forked),
    so every rank draws the same order; rank ``r`` of ``W`` takes positions ``r, r + W, ...``. The
    order is cut to a multiple of ``W`` (``drop_last``) or padded from its start, so every rank takes
    the same number of steps. A ``SubsetRandomSampler`` still yields only its subset; a
    ``WeightedRandomSampler`` keeps its weights.

    Example:
        >>> from torch.utils.data import SubsetRandomSampler
        >>> parts = [list(RankSlicedSampler(SubsetRandomSampler([1, 3, 5, 7]), rank=r, world_size=2)) for r in (0, 1)]
        >>> sorted(parts[0] + parts[1])
        [1, 3, 5, 7]
    """

    def __init__(self, sampler: Sampler, *, rank: int, world_size: int, seed: int = 0, drop_last: bool = False) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"RankSlicedSampler(): rank={rank} is outside 0..{world_size - 1}.")
        self.sampler, self.rank, self.world_size = sampler, rank, world_size
        self.seed, self.drop_last, self.epoch = int(seed), bool(drop_last), 0

    def set_epoch(self, epoch: int) -> None:
        """Draw epoch ``epoch``'s order next (the same on every rank)."""
        self.epoch = int(epoch)
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def _order(self) -> list[Any]:
        seed = self.seed + self.epoch
        own = getattr(self.sampler, "generator", None)
        if isinstance(own, torch.Generator):
            # The user's generator advances per rank in lockstep only if every rank seeded it alike;
            # a generator seeded per epoch makes the order the same everywhere, and theirs is left as it was.
            self.sampler.generator = torch.Generator().manual_seed(seed)
            try:
                return list(self.sampler)
            finally:
                self.sampler.generator = own
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return list(self.sampler)

    def __len__(self) -> int:
        total = len(self.sampler)
        return total // self.world_size if self.drop_last else -(-total // self.world_size)

    def __iter__(self) -> Iterator[Any]:
        order = self._order()
        size = len(order) // self.world_size * self.world_size if self.drop_last else len(self) * self.world_size
        if order and len(order) < size:  # pad from the start, as DistributedSampler does
            order = (order * (-(-size // len(order))))[:size]
        return iter(order[self.rank : size : self.world_size])


def _plain_order(sampler: Sampler, dataset: Any) -> Optional[bool]:
    """``shuffle`` for a ``DistributedSampler`` that means the same as ``sampler`` (each sample once, in order
    or permuted), else ``None``: the sampler has its own semantics and is wrapped instead."""
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(dataset):
        return True
    return None


def shard_dataloader(
    dataloader: Any,
    *,
    rank: int,
    world_size: int,
    epoch: int = 0,
    data_sampler: Any = None,
    caller: str = "shard_dataloader()",
) -> tuple[Any, Optional[Sampler]]:
    """Give data-parallel rank ``rank`` of ``world_size`` its own part of ``dataloader``; return (loader, sampler).

    With ``data_sampler``: its ``transform_dataloader(dataloader)`` (NeMo), or a rebuilt loader
    using it as sampler. Otherwise the loader is rebuilt around a ``DistributedSampler`` (shuffling
    when the original did, at ``epoch``); a loader with its own sampler (``SubsetRandomSampler``,
    ``WeightedRandomSampler``, any other) keeps it, wrapped in a ``RankSlicedSampler`` that gives each
    rank a disjoint share of that sampler's order. A loader that already has a ``DistributedSampler`` is kept;
    an ``IterableDataset`` is returned unchanged (with a warning: it must shard itself). The sampler
    returned (or ``None``) is the one whose ``set_epoch`` reshuffles.

    Example:
        loader, sampler = shard_dataloader(DataLoader(ds, batch_size=4, shuffle=True), rank=0, world_size=2)
        sampler.set_epoch(1)
    """
    kept = _kept_loader(dataloader, data_sampler, caller)
    if kept is not None:
        return kept
    if dataloader.batch_size is None:
        raise ValueError(
            f"{caller}: the loader uses a custom batch_sampler; pass data_sampler= "
            "with a transform_dataloader(dataloader) method that splits it by data-parallel rank."
        )
    if data_sampler is not None and not isinstance(data_sampler, Sampler):
        raise ValueError(
            "FSDP2Strategy: data_sampler must be a torch Sampler or have transform_dataloader(dataloader)."
        )
    sampler = data_sampler if data_sampler is not None else _rank_sampler(dataloader, rank, world_size, epoch)
    return _with_sampler(dataloader, sampler), sampler


def _kept_loader(dataloader: Any, data_sampler: Any, caller: str) -> Optional[tuple[Any, Optional[Sampler]]]:
    """``shard_dataloader``'s answer where no new sampler is made (``None`` elsewhere): ``data_sampler``'s
    ``transform_dataloader``, an ``IterableDataset`` (it must shard itself), a ``DistributedSampler``'s loader.
    Anything but a ``DataLoader`` is refused."""
    if data_sampler is not None and callable(getattr(data_sampler, "transform_dataloader", None)):
        return data_sampler.transform_dataloader(dataloader), None
    if not isinstance(dataloader, DataLoader):
        raise ValueError(
            f"{caller}: expected a torch DataLoader, got {type(dataloader).__name__}; "
            "pass data_sampler= with a transform_dataloader(dataloader) method for other loaders."
        )
    if isinstance(dataloader.dataset, IterableDataset):
        warnings.warn(
            f"{caller}: an IterableDataset cannot be split by a sampler; "
            "it is returned unchanged, so it must shard itself by data-parallel rank.",
            stacklevel=4,
        )
        return dataloader, None
    if isinstance(dataloader.sampler, DistributedSampler) and data_sampler is None:
        return dataloader, dataloader.sampler
    return None


def _rank_sampler(dataloader: DataLoader, rank: int, world_size: int, epoch: int) -> Sampler:
    """This rank's sampler, at ``epoch``: a ``DistributedSampler`` for a plain order (shuffled or not),
    else the loader's own sampler sliced by rank (``RankSlicedSampler``)."""
    shuffle = _plain_order(dataloader.sampler, dataloader.dataset)
    if shuffle is None:
        sampler = RankSlicedSampler(
            dataloader.sampler, rank=rank, world_size=world_size, drop_last=dataloader.drop_last
        )
    else:
        sampler = DistributedSampler(
            dataloader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, drop_last=dataloader.drop_last
        )
    sampler.set_epoch(epoch)
    return sampler


def _with_sampler(dataloader: DataLoader, sampler: Sampler) -> DataLoader:
    """``dataloader`` rebuilt around ``sampler``, its other options kept."""
    kept = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn")
    options = {name: getattr(dataloader, name) for name in (*kept, "persistent_workers")}
    if dataloader.num_workers > 0:
        options["prefetch_factor"] = dataloader.prefetch_factor
    return DataLoader(dataloader.dataset, sampler=sampler, **options)


def _rank_and_world(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    """``(rank, world_size)``, each the given one else the process group's, else the launcher's. A loader
    is built before the process group exists (under torchrun, before fsdp() starts it): the launcher's
    RANK / WORLD_SIZE say which rank this is, as fsdp() will read them."""
    default_world = expected_world_size()
    default_rank = get_rank() if is_distributed() else (int(os.environ["RANK"]) if default_world > 1 else 0)
    world_size = int(world_size if world_size is not None else default_world)
    return int(rank if rank is not None else default_rank), world_size


def _check_loader_args(dataset: Any, global_batch_size: Any, rank: int, world_size: int, loader_kwargs: dict) -> None:
    """``ResumableLoader``'s arguments: a positive global batch that splits over the ranks and fits the
    dataset, a rank of the world, no ``DataLoader`` option the loader decides."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"ResumableLoader(): global_batch_size must be a positive int, got {global_batch_size!r}.")
    if global_batch_size % world_size:
        raise ValueError(
            f"ResumableLoader(): global_batch_size={global_batch_size} does not split over world_size="
            f"{world_size} ranks; use a multiple of {world_size}."
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"ResumableLoader(): rank={rank} is outside 0..{world_size - 1}.")
    for key in ("batch_size", "sampler", "batch_sampler", "shuffle", "drop_last"):
        if key in loader_kwargs:
            raise ValueError(f"ResumableLoader(): {key}= is decided by the loader (global_batch_size, seed, shuffle).")
    samples = len(dataset)
    if samples < global_batch_size:
        # Not one global batch fits (a last partial one is dropped): every epoch would be empty
        # and a `while step < total: for batch in loader:` loop would never end.
        raise ValueError(
            f"ResumableLoader(): the dataset has {samples} samples, fewer than one global batch "
            f"(global_batch_size={global_batch_size}); use a global batch of at most {samples} samples."
        )


class ResumableLoader:
    """Batches for this data-parallel rank from a stream of global batches that resumes exactly, at any world size.

    The stream is defined by *global* batches, so its position means the same at any world size: epoch
    ``e`` orders the dataset by ``torch.randperm(len, seed + e)`` (in order without ``shuffle``), cut into
    global batches of ``global_batch_size`` (a last partial one dropped); rank ``r`` of ``W`` gets the
    ``r``-th contiguous ``global_batch_size / W`` samples of each (docs/long_jobs.md). Iterating gives the
    rest of the current epoch; ``state_dict()`` (epoch, samples handed out, seed) resumes at any world size
    that divides the global batch, e.g. saved with ``CheckpointManager(state={"data": loader})``.

    ``rank`` / ``world_size`` default to the process group's, else the launcher's (``RANK`` / ``WORLD_SIZE``),
    else one process; pass the data-parallel ones under tensor parallelism. Other keyword arguments go to
    the ``DataLoader`` that reads the samples (``collate_fn``, ``num_workers``, ``pin_memory`` ...).

    Example:
        loader = ResumableLoader(dataset, global_batch_size=32, seed=0)
        for batch in loader:  # the rest of this epoch, this rank's 32 / world samples at a time
            train_step(batch)
        loader.state_dict()
        # -> {'epoch': 1, 'consumed': 0, 'seed': 0, 'global_batch_size': 32, 'shuffle': True, 'dataset_len': 1000}
    """

    def __init__(
        self,
        dataset: Any,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        **loader_kwargs: Any,
    ) -> None:
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        _check_loader_args(dataset, global_batch_size, self.rank, self.world_size, loader_kwargs)
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.epoch, self.consumed = 0, 0
        self.loader_kwargs = loader_kwargs

    def __len__(self) -> int:
        """Global batches per epoch (a last partial one is dropped).

        Example:
            >>> len(ResumableLoader(range(100), 32))
            3
        """
        return len(self.dataset) // self.global_batch_size

    def order(self, epoch: int) -> torch.Tensor:
        """The sample indices of ``epoch`` in stream order (the same on every rank and at every world size).
        Example: ``loader.order(0)[:4]`` -> ``tensor([ 3, 81, 47, 12])``."""
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        return torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch))

    def __iter__(self) -> Iterator[Any]:
        if self.consumed >= len(self) * self.global_batch_size:  # saved at the end of an epoch
            self.epoch, self.consumed = self.epoch + 1, 0
        size = self.global_batch_size
        per = size // self.world_size
        order, mine = self.order(self.epoch), self.rank * per
        starts = range(self.consumed // size * size, len(self) * size, size)
        batches = [order[start + mine : start + mine + per].tolist() for start in starts]
        for batch in DataLoader(self.dataset, batch_sampler=batches, **self.loader_kwargs):
            # Counted before the caller trains on it: a checkpoint taken after that step resumes after it.
            self.consumed += self.global_batch_size
            yield batch
        self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is: epoch, samples consumed in it, seed (and what must match to resume).
        Example: ``loader.state_dict()["consumed"]`` -> ``64``."""
        keys = ("epoch", "consumed", "seed", "global_batch_size", "shuffle")
        return {**{key: getattr(self, key) for key in keys}, "dataset_len": len(self.dataset)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position (any world size); the global batch size and dataset must match.
        Example: ``loader.load_state_dict(saved["data"])``."""
        mine = self.state_dict()
        for key in ("global_batch_size", "dataset_len", "shuffle"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"ResumableLoader.load_state_dict(): saved {key}={state[key]!r}, this loader has {mine[key]!r}; "
                    "an exact resume needs the same global batch size, dataset and shuffling."
                )
        self.epoch, self.consumed, self.seed = int(state["epoch"]), int(state["consumed"]), int(state["seed"])

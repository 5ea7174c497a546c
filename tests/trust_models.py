"""Models written the ways users write them, which ``fsdp()`` must trust (one unit per block): the blocks
reached through a helper function, a decorated forward, a first argument not called ``self``, a forward
borrowed from another class, a source that cannot be read; and models with evidence that a rank may skip
a block, or that skip one on purpose (the run-time divergence check's targets)."""

from __future__ import annotations

import functools
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, SEQ = 32, 8, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Plain(nn.Module):
    """Embedding, four blocks in a ModuleList, a head: the forward loops over the blocks."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def run_all(blocks: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        h = block(h)
    return h


class HelperFunction(Plain):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(run_all(self.blocks, self.emb(ids)))


def traced(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class Decorated(Plain):
    @traced
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids)


class This(Plain):
    def forward(this, ids: torch.Tensor) -> torch.Tensor:  # noqa: N805 - the pattern under test
        h = this.emb(ids)
        for block in this.blocks:
            h = block(h)
        return this.head(h)


class Borrowed(nn.Module):
    """The forward of another class, as a LightningModule shares its plain module's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(DIM, VOCAB)

    forward = HelperFunction.forward


_GENERATED = """
class Generated(Plain):
    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)
"""


def generated() -> nn.Module:
    """A class built by ``exec``: no source to read."""
    scope = {"Plain": Plain}
    exec(compile(_GENERATED, "<generated>", "exec"), scope)
    return scope["Generated"]()


TRUSTED = {
    "helper-function": HelperFunction,
    "decorated": Decorated,
    "this": This,
    "borrowed": Borrowed,
    "generated": generated,
}


class SkipSome(Plain):
    """Skips the blocks listed in ``self.skip`` (a setting, set per rank by the caller): no evidence to
    read, so its blocks are units; the run-time check must stop the ranks that diverge."""

    def __init__(self) -> None:
        super().__init__()
        self.skip: set[int] = set()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                h = block(h)
        return self.head(h)


class OptionalTower(Plain):
    """A tower run only for batches with an image: evidence (a call under a condition on the data)."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(Block(), Block())

    def forward(self, ids: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(ids)
        if image is not None:
            h = h + self.tower(image)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class StochasticDepth(Plain):
    """Drops whole blocks at random in training (drawn per rank): evidence."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            if self.training and torch.rand(()) < 0.5:
                continue
            h = block(h)
        return self.head(h)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Checkpointed(Plain):
    """timm/nanoGPT style: ``checkpoint`` imported by name (torch's own source is not the user's)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.head(h)


class KVCache(Plain):
    """GPT-2's ``past[i] if past is not None else None``: the index reads the data, the block runs always."""

    def forward(self, ids: torch.Tensor, past: list | None = None) -> torch.Tensor:
        h = self.emb(ids)
        for i, block in enumerate(self.blocks):
            layer_past = past[i] if past is not None else None
            h = block(h) if layer_past is None else block(h + layer_past)
        return self.head(h)


class EarlyReturn(Plain):
    """A guard before any unit runs: no forward at all, not a skipped unit."""

    def forward(self, ids: torch.Tensor | None = None) -> torch.Tensor | None:
        if ids is None:
            return None
        return super().forward(ids)


class TwoHeads(Plain):
    """A ModuleDict of two heads beside the blocks: Linear is no block class."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({"a": nn.Linear(DIM, 2), "b": nn.Linear(DIM, 3)})


class RandomSubset(Plain):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for i in torch.randperm(4)[:2]:
            h = self.blocks[i](h)
        return self.head(h)


class DropByMethod(Plain):
    def _drop(self) -> bool:
        return random.random() < 0.5

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            if self._drop():
                continue
            h = block(h)
        return self.head(h)


TRUSTED.update(checkpointed=Checkpointed, kv_cache=KVCache, early_return=EarlyReturn, two_heads=TwoHeads)

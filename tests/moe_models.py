"""A small hand-written mixture-of-experts language model whose routing the tests control.

Each token goes to one expert chosen from its id (``id * experts // vocab``), so a batch drawn by
``routed_batch`` sends each rank's tokens to its own experts: at 2 ranks rank 0 uses experts {0, 1}
and rank 1 experts {2, 3}. An expert no token reached is skipped (``if mask.any()``), as MoE
layers do: its parameters get no gradient on that rank.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, SEQ = 64, 16, 6


class Expert(nn.Module):
    """A two-layer MLP (a block-like class: more than one weight layer)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoELayer(nn.Module):
    """Runs each token through the expert ``route`` names; experts no token reached do not run."""

    def __init__(self, dim: int, hiddens: Sequence[int]) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert(dim, h) for h in hiddens)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            mask = route == i
            if mask.any():
                out[mask] = expert(x[mask])
        return out


class MLP(Expert):
    """The same two-layer MLP under another name: used as experts and as plain blocks alike."""


def dispatch(layers: nn.ModuleList, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
    """A module-level helper running each token through its expert (the holder's forward shows no loop)."""
    out = torch.zeros_like(x)
    for i, layer in enumerate(layers):
        mask = route == i
        if mask.any():
            out[mask] = layer(x[mask])
    return out


def hits(route: torch.Tensor) -> list[int]:
    """The expert ids a batch reached."""
    return route.unique().tolist()


class HelperMoELayer(nn.Module):
    """Experts in ``self.layers`` (no name saying "expert"), dispatched by ``dispatch()``."""

    def __init__(self, dim: int, hiddens: Sequence[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP(dim, h) for h in hiddens)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return dispatch(self.layers, x, route)


class HitsMoELayer(nn.Module):
    """Experts run in a comprehension over the ids ``hits()`` returns."""

    def __init__(self, dim: int, hiddens: Sequence[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP(dim, h) for h in hiddens)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        ids = hits(route)
        outs = [self.layers[i](x[route == i]) for i in ids]
        for i, o in zip(ids, outs):
            out[route == i] = o
        return out


def dispatch_attrs(layer: nn.Module, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for i in range(layer.n):
        mask = route == i
        if mask.any():
            out[mask] = getattr(layer, f"expert{i}")(x[mask])
    return out


class AttrMoELayer(nn.Module):
    """Experts as attributes ``expert0 .. expertN`` reached by ``getattr`` in a helper, under a condition."""

    def __init__(self, dim: int, hiddens: Sequence[int]) -> None:
        super().__init__()
        self.n = len(hiddens)
        for i, h in enumerate(hiddens):
            self.add_module(f"expert{i}", MLP(dim, h))

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return dispatch_attrs(self, x, route)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, hiddens: Sequence[int], layer: type = MoELayer) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.moe = layer(dim, hiddens)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x), route)


class MoELM(nn.Module):
    """Embedding, ``layers`` MoE blocks, final norm and head (untied)."""

    def __init__(self, layers: int = 2, hiddens: Sequence[int] = (8, 8, 8, 8), layer: type = MoELayer) -> None:
        super().__init__()
        self.n_experts = len(hiddens)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MoEBlock(DIM, hiddens, layer) for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        route = ids * self.n_experts // VOCAB
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, route)
        return self.head(self.norm(h))


class Towered(nn.Module):
    """Blocks of ``MLP`` always run; a vision tower of the same class runs only when a batch has an image."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(MLP(DIM, 8), MLP(DIM, 8))
        self.vision = nn.Sequential(MLP(DIM, 8), MLP(DIM, 8))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        h = self.blocks(self.emb(ids))
        batch_has_image = image is not None
        if batch_has_image:
            h = h + self.vision(image).mean(1, keepdim=True)
        return self.head(h)


def moe_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def routed_batch(step: int, ranks: int, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` whose rank-``r`` slice (``batch // ranks`` rows) holds token ids in the
    ``r``-th of ``ranks`` equal ranges of the vocabulary only: each rank's tokens reach its own experts."""
    g = torch.Generator().manual_seed(500 + step)
    span, per = VOCAB // ranks, batch // ranks
    rows = [r * span + torch.randint(0, span, (per, SEQ), generator=g) for r in range(ranks)]
    x = torch.cat(rows)
    return x, torch.randint(0, VOCAB, x.shape, generator=g)


# Which experts each rank's tokens reach, step by step (``idle_batch``): in some steps an expert no
# rank's tokens reach (idle everywhere: the reference leaves its ``.grad`` None), in some an expert
# only one rank's tokens reach. Keys: the number of ranks; one tuple of expert sets per step.
IDLE_ROUTES: dict[int, list[tuple[set[int], ...]]] = {
    2: [({0}, {0}), ({0, 1}, {2}), ({3}, {1, 3}), ({0, 1}, {2, 3}), ({2}, {2}), ({1}, {0})],
    4: [
        ({0}, {0}, {0}, {0}),
        ({0, 1}, {2}, {0}, {1}),
        ({3}, {1, 3}, {3}, {3}),
        ({0}, {1}, {2}, {3}),
        ({2}, {2}, {2}, {0}),
        ({1}, {0}, {1}, {0}),
    ],
}


def idle_batch(step: int, ranks: int, batch: int = 8, n_experts: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` whose rank-``r`` slice reaches exactly the experts ``IDLE_ROUTES[ranks]``
    names for ``step`` (cycled), each of them with at least one token."""
    g = torch.Generator().manual_seed(700 + step)
    span, per = VOCAB // n_experts, batch // ranks
    rows = []
    for experts in IDLE_ROUTES[ranks][step % len(IDLE_ROUTES[ranks])]:
        picks = torch.tensor(sorted(experts))[torch.arange(per * SEQ) % len(experts)]  # every one picked
        picks = picks[torch.randperm(per * SEQ, generator=g)]
        rows.append((picks * span + torch.randint(0, span, picks.shape, generator=g)).view(per, SEQ))
    x = torch.cat(rows)
    return x, torch.randint(0, VOCAB, x.shape, generator=g)

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


class MoEBlock(nn.Module):
    def __init__(self, dim: int, hiddens: Sequence[int]) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.moe = MoELayer(dim, hiddens)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x), route)


class MoELM(nn.Module):
    """Embedding, ``layers`` MoE blocks, final norm and head (untied)."""

    def __init__(self, layers: int = 2, hiddens: Sequence[int] = (8, 8, 8, 8)) -> None:
        super().__init__()
        self.n_experts = len(hiddens)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MoEBlock(DIM, hiddens) for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        route = ids * self.n_experts // VOCAB
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, route)
        return self.head(self.norm(h))


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

"""A tiny GPT written with einops: the model the examples, tests and benchmarks shard.

Everything FSDP has to get right is in it on purpose: a ``ModuleList`` of blocks, an input
embedding tied to the output head, a final norm, a buffer (the causal mask), and ``init_weights()``
so it can be built on the ``meta`` device and materialized after sharding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange


@dataclass
class GPTConfig:
    vocab_size: int = 37
    dim: int = 30
    n_heads: int = 3
    n_layers: int = 3
    max_seq_len: int = 16
    tie_weights: bool = True


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        # No qkv bias: a key bias gets an exactly-zero gradient (softmax is shift-invariant),
        # which Adam would turn into rank-dependent noise-driven updates.
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_heads)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
        t = x.shape[1]
        scores = scores.masked_fill(~mask[:t, :t], float("-inf"))
        out = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(dim=-1), v)
        return self.proj(rearrange(out, "b h t d -> b t (h d)"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.register_buffer("causal_mask", torch.ones(cfg.max_seq_len, cfg.max_seq_len, dtype=torch.bool).tril())
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and refill the mask: what runs after meta-device sharding."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        self.causal_mask.copy_(torch.ones_like(self.causal_mask).tril())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.causal_mask)
        return self.head(self.norm(x))


def small(**overrides) -> GPT:
    """The demo/test model: odd sizes so shards are uneven, 3 blocks, tied embedding/head."""
    return GPT(GPTConfig(**overrides))


def llama_1b_config() -> GPTConfig:
    """A ~1B-parameter shape (Llama-3.2-1B-like widths) for wrap-time benchmarks on ``meta``."""
    return GPTConfig(vocab_size=128256, dim=2048, n_heads=32, n_layers=16, max_seq_len=2048)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(rearrange(logits, "b t v -> (b t) v"), rearrange(targets, "b t -> (b t)"))

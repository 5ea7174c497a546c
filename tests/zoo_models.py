"""The tests' tiny models: configs of models nobody here wrote (no downloads), and their batches.

``HF`` is the one home of the tiny Hugging Face configs: ``hf_cases.py`` saves and loads them
(weights in and out), the parity zoo (``ZOO``) trains them. Each zoo entry builds a model with
dropout off (deterministic reference) and a ``batch(step, n)`` function giving the same ``n``
examples on every rank for a given step; ``loss(model, batch)`` is the scalar the model is trained
on. The zoo is shared by ``test_zoo.py`` (plans, no process group) and ``zoo_cases.py`` (parity on
2 gloo ranks); ``timm_models.py`` builds its entries with ``ZooEntry``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812

VOCAB, SEQ, HIDDEN, IMAGE = 64, 8, 32, 8


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def _ids(step: int, n: int, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seq), generator=_gen(step))


def _lm_batch(step: int, n: int) -> dict:
    ids = _ids(step, n)
    return {"input_ids": ids, "labels": ids}


def _hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


# ----------------------------------------------------------------------------------- small models


class TimmBlock(nn.Module):
    """A timm-style pre-norm ViT block (attention + MLP), kept in an ``nn.Sequential``."""

    def __init__(self, dim: int = HIDDEN, heads: int = 4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TimmViT(nn.Module):
    """timm's ``VisionTransformer`` layout: ``patch_embed``, ``cls_token``, ``blocks = nn.Sequential``."""

    def __init__(self, depth: int = 2, dim: int = HIDDEN, patch: int = 4, image: int = 8, classes: int = 10):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + (image // patch) ** 2, dim) * 0.02)
        self.blocks = nn.Sequential(*[TimmBlock(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class Seq2SeqTransformer(nn.Module):
    """``torch.nn.Transformer`` with token embeddings and an output head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.transformer = nn.Transformer(
            HIDDEN, 4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.out(self.transformer(self.embed(src), self.embed(tgt)))


class TitanAttention(nn.Module):
    """Grouped-query attention with rotary embeddings, written as torchtitan writes its Llama 3."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim)
        q, k = (_rotate(z, freqs) for z in (q, k))
        rep = self.heads // self.kv_heads
        k, v = (z.repeat_interleave(rep, dim=2) for z in (k, v))
        out = F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v)), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


def _rotate(z: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(z.float().reshape(*z.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[: z.shape[1], None, :]).flatten(3).type_as(z)


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attention = TitanAttention(dim, heads, kv_heads)
        self.feed_forward = TitanFeedForward(dim, hidden)
        self.attention_norm = nn.RMSNorm(dim)
        self.ffn_norm = nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """torchtitan's Llama 3 layout (our own code): ``tok_embeddings``, ``layers = nn.ModuleDict()``
    keyed by layer index (so pipeline stages can drop layers without renaming), ``norm``,
    ``output``, and a non-persistent ``freqs_cis`` buffer filled by ``init_weights()``."""

    def __init__(self, dim: int = HIDDEN, n_layers: int = 2, heads: int = 4, kv_heads: int = 2, hidden: int = 64):
        super().__init__()
        self.head_dim = dim // heads
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.register_buffer("freqs_cis", self._freqs(), persistent=False)
        self.layers = nn.ModuleDict()
        for layer_id in range(n_layers):
            self.layers[str(layer_id)] = TitanBlock(dim, heads, kv_heads, hidden)
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def _freqs(self) -> torch.Tensor:
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        return torch.polar(torch.ones(SEQ * 2, self.head_dim // 2), torch.outer(torch.arange(SEQ * 2).float(), inv))

    def init_weights(self) -> None:
        self.freqs_cis = self._freqs().to(self.freqs_cis.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class ConvBlock(nn.Module):
    """A ConvNeXt-like residual block: depthwise conv, norm, pointwise MLP."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm = nn.GroupNorm(1, dim)
        self.pw1 = nn.Conv2d(dim, 2 * dim, 1)
        self.pw2 = nn.Conv2d(2 * dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw2(F.gelu(self.pw1(self.norm(self.dwconv(x)))))


class Stage(nn.Module):
    """A stage as timm's Swin/ConvNeXt write it: a downsampling layer, then ``blocks = nn.Sequential``."""

    def __init__(self, cin: int, cout: int, depth: int):
        super().__init__()
        self.downsample = nn.Conv2d(cin, cout, 2, 2) if cin != cout else nn.Identity()
        self.blocks = nn.Sequential(*[ConvBlock(cout) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class StagedNet(nn.Module):
    """Hierarchical: ``stages = nn.Sequential(Stage, Stage)``, each holding repeated ``ConvBlock``s."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 2, 2)
        self.stages = nn.Sequential(Stage(8, 8, 2), Stage(8, 16, 2))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class UnrolledStage(nn.Module):
    """timm RegNet's ``RegStage`` layout: blocks as repeated named attributes ``b1 .. bN``."""

    def __init__(self, cin: int, cout: int, depth: int):
        super().__init__()
        self.proj = nn.Conv2d(cin, cout, 1)
        for i in range(depth):
            self.add_module(f"b{i + 1}", ConvBlock(cout))
        self.depth = depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for i in range(self.depth):
            x = getattr(self, f"b{i + 1}")(x)
        return x


class UnrolledNet(nn.Module):
    """Stages as named attributes ``s1, s2`` (RegNet), blocks as ``b1 .. bN`` inside each."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 2, 2)
        self.s1 = UnrolledStage(8, 8, 2)
        self.s2 = UnrolledStage(8, 16, 3)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.s2(self.s1(self.stem(x))).mean((2, 3)))


def _titan_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["input_ids"][:, 1:].reshape(-1))


def _encoder_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["x"]).pow(2).mean()


def _encoder_batch(step: int, n: int) -> dict:
    return {"x": torch.randn(n, SEQ, HIDDEN, generator=_gen(step))}


def _torch_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(HIDDEN, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _image_batch(step: int, n: int) -> dict:
    g = _gen(step)
    return {"x": torch.randn(n, 3, 8, 8, generator=g), "y": torch.randint(0, 10, (n,), generator=g)}


def _seq2seq_batch(step: int, n: int) -> dict:
    g = _gen(step)
    src = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return {"src": src, "tgt": tgt}


# ----------------------------------------------------------------------------------- the zoo


@dataclass
class ZooEntry:
    """How to build one zoo model, feed it and score it; ``units``: the unit names ``fsdp(auto_wrap=True)`` must make."""

    build: Callable[[], nn.Module]
    batch: Callable[[int, int], dict]
    loss: Callable[[nn.Module, dict], torch.Tensor]
    units: list[str]
    # False: FSDP's backward hooks change the order in which autograd sums some gradient
    # contributions (T5: one weight serving embeddings and head, a position bias shared by every
    # layer), so fp32 sums differ by rounding; zoo_cases.py then uses SGD and a derived bound.
    exact: bool = True


@dataclass(frozen=True)
class HFArch:
    """A tiny transformers model: its class, the ``AutoModel*`` class that loads it, and its config."""

    model: str
    auto: str
    config: str
    kwargs: dict

    def classes(self) -> tuple[type, type, Any]:
        """``(model class, Auto class, config)``: what ``hf_cases.py`` saves and loads with."""
        import transformers

        cls, auto = getattr(transformers, self.model), getattr(transformers, self.auto)
        return cls, auto, getattr(transformers, self.config)(**self.kwargs)

    def build(self) -> nn.Module:
        cls, _, cfg = self.classes()
        return cls(cfg)


_DEC = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
_ENC = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
_TOWER = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
_CAUSAL = "AutoModelForCausalLM"

# The one home of the tests' tiny Hugging Face configs: the parity zoo (``ZOO`` below) trains them,
# ``hf_cases.py`` saves and loads them (``classes()``); dropout off, so every build is deterministic.
HF: dict[str, HFArch] = {
    "llama_tied": HFArch("LlamaForCausalLM", _CAUSAL, "LlamaConfig", dict(_DEC, tie_word_embeddings=True)),
    "llama_untied": HFArch("LlamaForCausalLM", _CAUSAL, "LlamaConfig", dict(_DEC, tie_word_embeddings=False)),
    "gpt2": HFArch(
        "GPT2LMHeadModel",
        _CAUSAL,
        "GPT2Config",
        dict(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    "mixtral": HFArch(
        "MixtralForCausalLM", _CAUSAL, "MixtralConfig", dict(_DEC, num_local_experts=4, num_experts_per_tok=2)
    ),
    "t5": HFArch(
        "T5ForConditionalGeneration",
        "AutoModelForSeq2SeqLM",
        "T5Config",
        dict(
            vocab_size=VOCAB,
            d_model=HIDDEN,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        ),
    ),
    "bart": HFArch(
        "BartForConditionalGeneration",
        "AutoModelForSeq2SeqLM",
        "BartConfig",
        dict(
            vocab_size=VOCAB,
            d_model=HIDDEN,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        ),
    ),
    "bert_mlm": HFArch("BertForMaskedLM", "AutoModelForMaskedLM", "BertConfig", _ENC),
    "vit": HFArch(
        "ViTForImageClassification",
        "AutoModelForImageClassification",
        "ViTConfig",
        dict(
            image_size=IMAGE,
            patch_size=4,
            num_labels=10,
            **{k: v for k, v in _ENC.items() if k not in ("vocab_size", "max_position_embeddings")},
        ),
    ),
    "wav2vec2": HFArch(
        "Wav2Vec2ForCTC",
        "AutoModelForCTC",
        "Wav2Vec2Config",
        dict(
            vocab_size=16,
            **_TOWER,
            conv_dim=(16, 16),
            conv_stride=(5, 4),
            conv_kernel=(10, 4),
            num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            feat_proj_dropout=0.0,
            final_dropout=0.0,
            layerdrop=0.0,
            mask_time_prob=0.0,
            ctc_zero_infinity=True,
            ctc_loss_reduction="mean",
        ),
    ),
    "clip": HFArch(
        "CLIPModel",
        "AutoModel",
        "CLIPConfig",
        dict(
            text_config=dict(vocab_size=VOCAB, **_TOWER, max_position_embeddings=SEQ),
            vision_config=dict(**_TOWER, image_size=IMAGE, patch_size=4),
            projection_dim=16,
        ),
    ),
    # dims that do not split evenly over 2 ranks (FSDP2 pads the last shard)
    "llama_uneven": HFArch(
        "LlamaForCausalLM",
        _CAUSAL,
        "LlamaConfig",
        dict(
            vocab_size=97,
            hidden_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=41,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
    ),
}


def _timm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def _seq2seq_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["src"], batch["tgt"][:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["tgt"][:, 1:].reshape(-1))


def _t5_batch(step: int, n: int) -> dict:
    return {"input_ids": _ids(step, n), "labels": _ids(step + 500, n, SEQ // 2)}


def _vit_batch(step: int, n: int) -> dict:
    g = _gen(step)
    return {"pixel_values": torch.randn(n, 3, 8, 8, generator=g), "labels": torch.randint(0, 10, (n,), generator=g)}


def _audio_batch(step: int, n: int) -> dict:
    g = _gen(step)
    return {"input_values": torch.randn(n, 400, generator=g), "labels": torch.randint(1, 16, (n, 3), generator=g)}


def _clip_batch(step: int, n: int) -> dict:
    g = _gen(step)
    return {
        "input_ids": torch.randint(0, VOCAB, (n, SEQ), generator=g),
        "pixel_values": torch.randn(n, 3, 8, 8, generator=g),
        "return_loss": True,
    }


ZOO: dict[str, ZooEntry] = {
    "llama_tied": ZooEntry(
        HF["llama_tied"].build,
        _lm_batch,
        _hf_loss,
        ["model.layers.0", "model.layers.1", "[model.embed_tokens, model.norm, lm_head]", "<root>"],
    ),
    "llama_untied": ZooEntry(
        HF["llama_untied"].build,
        _lm_batch,
        _hf_loss,
        ["model.layers.0", "model.layers.1", "model.embed_tokens", "[model.norm, lm_head]", "<root>"],
    ),
    "gpt2": ZooEntry(
        HF["gpt2"].build,
        _lm_batch,
        _hf_loss,
        [
            "transformer.h.0",
            "transformer.h.1",
            "[transformer.wte, transformer.wpe, transformer.ln_f, lm_head]",
            "<root>",
        ],
    ),
    "mixtral": ZooEntry(
        HF["mixtral"].build,
        _lm_batch,
        _hf_loss,
        ["model.layers.0", "model.layers.1", "model.embed_tokens", "[model.norm, lm_head]", "<root>"],
    ),
    "t5": ZooEntry(
        HF["t5"].build,
        _t5_batch,
        _hf_loss,
        [
            "encoder.block.0",
            "encoder.block.1",
            "decoder.block.0",
            "decoder.block.1",
            "[shared, encoder.embed_tokens, +3 more]",
            "<root>",
        ],
        exact=False,
    ),
    "bert_mlm": ZooEntry(
        HF["bert_mlm"].build,
        _lm_batch,
        _hf_loss,
        ["bert.encoder.layer.0", "bert.encoder.layer.1", "[bert.embeddings, cls.predictions, +3 more]", "<root>"],
    ),
    "vit": ZooEntry(
        HF["vit"].build,
        _vit_batch,
        _hf_loss,
        ["vit.embeddings", "vit.layers.0", "vit.layers.1", "[vit.layernorm, classifier]", "<root>"],
    ),
    "wav2vec2": ZooEntry(
        HF["wav2vec2"].build,
        _audio_batch,
        _hf_loss,
        ["wav2vec2.encoder.layers.0", "wav2vec2.encoder.layers.1", "lm_head", "<root>"],
    ),
    "clip": ZooEntry(
        HF["clip"].build,
        _clip_batch,
        _hf_loss,
        [
            "text_model.embeddings",
            "text_model.encoder.layers.0",
            "text_model.encoder.layers.1",
            "vision_model.embeddings",
            "vision_model.encoder.layers.0",
            "vision_model.encoder.layers.1",
            "[vision_model.post_layernorm, visual_projection, text_projection]",
            "<root>",
        ],
    ),
    "torch_transformer": ZooEntry(
        Seq2SeqTransformer,
        _seq2seq_batch,
        _seq2seq_loss,
        [
            "transformer.encoder.layers.0",
            "transformer.encoder.layers.1",
            "transformer.decoder.layers.0",
            "transformer.decoder.layers.1",
            "embed",
            "[transformer.decoder.norm, out]",
            "<root>",
        ],
    ),
    "timm_vit": ZooEntry(TimmViT, _image_batch, _timm_loss, ["blocks.0", "blocks.1", "[norm, head]", "<root>"]),
    # torchtitan's Llama 3 layout: blocks in an nn.ModuleDict
    "titan_llama": ZooEntry(
        TitanLlama,
        _lm_batch,
        _titan_loss,
        ["layers.0", "layers.1", "tok_embeddings", "[norm, output]", "<root>"],
    ),
    "torch_encoder": ZooEntry(_torch_encoder, _encoder_batch, _encoder_loss, ["layers.0", "layers.1", "<root>"]),
    # hierarchical: the innermost repeated block, not the stage (the stages' downsampling goes to the root)
    "staged": ZooEntry(
        StagedNet,
        _image_batch,
        _timm_loss,
        ["stages.0.blocks.0", "stages.0.blocks.1", "stages.1.blocks.0", "stages.1.blocks.1", "head", "<root>"],
    ),
    # repeated named attributes b1 .. bN inside named stages s1, s2 (timm RegNet)
    "unrolled": ZooEntry(
        UnrolledNet,
        _image_batch,
        _timm_loss,
        ["s1.b1", "s1.b2", "s2.b1", "s2.b2", "s2.b3", "head", "<root>"],
    ),
}

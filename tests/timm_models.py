"""timm models (real timm code, no downloads) for ``test_timm.py`` / ``timm_cases.py``.

timm imports torchvision, so these run where torchvision is installable beside torch (the CI
environment with the newest torch); ``test_timm.py`` skips as a whole elsewhere.

``PLANS``: default configurations built on ``meta`` (nothing allocated), with the block class
``fsdp(auto_wrap=True)`` must pick. ``TINY``: small configurations trained on 2 ranks against a
single-process reference (``zoo_cases.zoo_parity``), with the units they must get.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812
from zoo_models import ZooEntry, _gen

# model name -> (the block class names fsdp(auto_wrap=True) must pick, the stage class it must not)
PLANS: dict[str, tuple[set[str], str]] = {
    "vit_tiny_patch16_224": ({"Block"}, ""),
    "deit_tiny_patch16_224": ({"Block"}, ""),
    "eva02_tiny_patch14_224": ({"EvaBlock"}, ""),
    "beit_base_patch16_224": ({"Block"}, ""),
    "mixer_s16_224": ({"MixerBlock"}, ""),
    "swin_tiny_patch4_window7_224": ({"SwinTransformerBlock"}, "SwinTransformerStage"),
    "convnext_atto": ({"ConvNeXtBlock"}, "ConvNeXtStage"),
    "coatnet_nano_rw_224": ({"MbConvBlock", "TransformerBlock2d"}, "MaxxVitStage"),
    "resnet18": ({"BasicBlock"}, ""),
    "resnet50": ({"Bottleneck"}, ""),
    "efficientnet_b0": ({"InvertedResidual"}, ""),
    "mobilenetv3_small_050": ({"InvertedResidual"}, ""),
    "regnetx_002": ({"Bottleneck"}, "RegStage"),
}


def build(name: str, **kwargs) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, **kwargs)


def _batch(size: int):
    def batch(step: int, n: int) -> dict:
        g = _gen(step)
        return {"x": torch.randn(n, 3, size, size, generator=g), "y": torch.randint(0, 10, (n,), generator=g)}

    return batch


def _loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def _tiny(name: str, size: int, units: list[str], **kwargs) -> ZooEntry:
    return ZooEntry(lambda: build(name, num_classes=10, **kwargs), _batch(size), _loss, units)


_VIT = dict(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2)
TINY: dict[str, ZooEntry] = {
    "vit": _tiny("vit_tiny_patch16_224", 16, ["blocks.0", "blocks.1", "[norm, head]", "<root>"], **_VIT),
    "eva02": _tiny("eva02_tiny_patch14_224", 16, ["blocks.0", "blocks.1", "[fc_norm, head]", "<root>"], **_VIT),
    "swin": _tiny(
        "swin_tiny_patch4_window7_224",
        32,
        [
            "layers.0.blocks.0",
            "layers.0.blocks.1",
            "layers.1.blocks.0",
            "layers.1.blocks.1",
            "[norm, head.fc]",
            "<root>",
        ],
        img_size=32,
        window_size=2,
        embed_dim=16,
        depths=(2, 2),
        num_heads=(2, 4),
    ),
    "convnext": _tiny(
        "convnext_atto",
        32,
        [
            "stages.0.blocks.0",
            "stages.0.blocks.1",
            "stages.1.blocks.0",
            "stages.1.blocks.1",
            "stages.2.blocks.0",
            "stages.3.blocks.0",
            "[head.norm, head.fc]",
            "<root>",
        ],
        depths=(2, 2, 1, 1),
        dims=(8, 16, 16, 16),
    ),
    "resnet18": _tiny(
        "resnet18", 32, ["layer1.0", "layer2.0", "layer3.0", "layer4.0", "fc", "<root>"], layers=(1, 1, 1, 1)
    ),
    "mobilenetv3": _tiny(
        "mobilenetv3_small_050",
        32,
        [
            *[f"blocks.{s}.{b}" for s, n in ((1, 2), (2, 3), (3, 2), (4, 3)) for b in range(n)],
            "[blocks.5.0.conv, blocks.5.0.bn1, conv_head, classifier]",
            "<root>",
        ],
    ),
}

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="zeta-fsdp",
    version="0.1.0",
    description="One line that turns any PyTorch model into a correctly sharded FSDP2 model.",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["zeta_fsdp", "zeta_fsdp.*"]),
    python_requires=">=3.9",
    # What the package imports, nothing else (tests/test_install.py runs the demo from a wheel):
    # torch; einops (zeta_fsdp.models.gpt, the demo's model); numpy, because
    # torch.distributed.tensor.debug (CommDebugMode: zeta_fsdp.measure, the demo) imports it
    # and torch does not depend on it. The torch floor is the oldest release the suite passes
    # on (docs/install.md: the table scripts/torch_versions.py writes); zeta_fsdp/torch_compat.py's
    # MIN_TORCH says the same and refuses an older torch at import (tests/test_torch_compat.py).
    install_requires=["torch>=2.10", "einops", "numpy"],
    extras_require={
        # load_pretrained / save_pretrained / consolidate_to_hf (transformers' key conversions, configs)
        "hf": ["transformers>=5", "safetensors", "accelerate"],  # accelerate: zeta_fsdp.integrations (Trainer)
        "lightning": ["lightning>=2.4"],
        # everything the suite needs: the optional integrations, the .safetensors export, the demo plot.
        # (timm needs torchvision, which must match torch: tests/test_timm.py runs where both are installed)
        # setuptools>=70.1 builds wheels itself (bdist_wheel): tests/test_install.py builds ours
        # without build isolation, and a fresh venv on Python < 3.12 brings setuptools 65.
        "test": [
            "pytest",
            "pytest-xdist",  # the README's command runs test files two at a time (-n 2)
            "safetensors",
            "matplotlib",
            "transformers>=5",
            "peft",
            "accelerate",  # tests/test_trainer.py: transformers' Trainer runs on it
            "lightning>=2.4",
            "setuptools>=70.1",
        ],
        "dev": ["ruff==0.17.6", "pytest"],
        "bench": ["matplotlib", "accelerate"],
        "demo": ["tqdm", "matplotlib"],
        "docs": ["safetensors", "transformers>=5", "peft"],
        "safetensors": ["safetensors"],
    },
)

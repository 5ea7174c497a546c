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
    # numpy: torch.distributed.tensor.debug (CommDebugMode, used by the demo and measurements)
    # imports it, and torch itself does not depend on it.
    install_requires=["torch>=2.6", "einops", "typing-extensions", "numpy"],
    extras_require={
        # safetensors and matplotlib let the suite cover the .safetensors export and the demo plot
        "test": ["pytest", "safetensors", "matplotlib", "lightning>=2.4", "transformers>=5"],
        "dev": ["ruff==0.17.6", "pytest"],
        "bench": ["matplotlib", "accelerate"],
        "demo": ["tqdm", "matplotlib"],
        "docs": ["safetensors", "transformers>=5"],
        # load_pretrained / save_pretrained / consolidate_to_hf (transformers' key conversions, configs)
        "hf": ["transformers>=5", "safetensors"],
        "safetensors": ["safetensors"],
        "lightning": ["lightning>=2.4"],
    },
)

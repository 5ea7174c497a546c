"""Model specs of the command line: ``package.module:factory`` or a Hugging Face config, built on ``meta``.

``python -m zeta_fsdp plan MODEL`` names its model with a spec; ``meta_model_from_spec`` builds it
without allocating (the ``meta`` device) and never downloads.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
import torch.nn as nn

__all__ = ["MODEL_SPEC_HELP", "importable_cwd", "meta_model_from_spec"]

MODEL_SPEC_HELP = (
    "'package.module:factory' (e.g. zeta_fsdp.models.gpt:small), a local Hugging Face config.json (or its folder), "
    "or a transformers config class name (e.g. LlamaConfig)"
)


@contextlib.contextmanager
def importable_cwd() -> Iterator[None]:
    """Make the current folder importable while inside (as ``python -m`` does), then restore ``sys.path``:
    the command line's ``plan my_models:build`` finds ``./my_models.py``, and so does the dry-run
    subprocess (it inherits ``sys.path``). A library call of ``meta_model_from_spec`` uses ``sys.path`` as is."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def meta_model_from_spec(spec: str, overrides: Optional[dict[str, Any]] = None) -> nn.Module:
    """Build a model on ``meta`` from a command-line spec, with ``key=value`` overrides.

    ``"pkg.mod:factory"`` calls ``factory(**overrides)``; a path to a ``config.json`` (or a folder
    holding one) or a ``transformers`` config class name builds ``AutoModelForCausalLM.from_config``.
    Never downloads. Raises ``ValueError`` with a one-line reason when the spec cannot be used.

    Example:
        >>> model = meta_model_from_spec("zeta_fsdp.models.gpt:small", {"n_layers": 4})
        >>> next(model.parameters()).device
        device(type='meta')
    """
    overrides = dict(overrides or {})
    if ":" in spec and not Path(spec).exists():
        return _from_factory(spec, overrides)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ValueError(f"no config file at {str(path)!r}. MODEL is {MODEL_SPEC_HELP}.")
        return _from_hf_config(path, overrides)
    if spec.isidentifier() and spec.endswith("Config"):
        return _from_hf_config(spec, overrides)
    raise ValueError(f"cannot use {spec!r} as a model. MODEL is {MODEL_SPEC_HELP}.")


def _from_factory(spec: str, overrides: dict[str, Any]) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"cannot use {spec!r} as a model. MODEL is {MODEL_SPEC_HELP}.")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure is the user's path, not our bug
        raise ValueError(f"cannot import {module_name!r} ({type(e).__name__}: {e}). MODEL is {MODEL_SPEC_HELP}.") from e
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"{module_name!r} has no attribute {attr!r}. MODEL is {MODEL_SPEC_HELP}.")
    if not callable(factory):
        raise ValueError(f"{spec!r} is not callable. MODEL is {MODEL_SPEC_HELP}.")
    try:
        with torch.device("meta"):
            model = factory(**overrides)
    except Exception as e:
        args = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
        raise ValueError(f"{spec}({args}) failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module.")
    return model


def _from_hf_config(source: Union[str, Path], overrides: dict[str, Any]) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ValueError("a Hugging Face config needs the 'transformers' package (pip install transformers).") from None
    fields: dict[str, Any] = {}
    if isinstance(source, Path):
        # The local file only: nothing is looked up on the Hub.
        fields = json.loads(source.read_text())
        model_type = fields.pop("model_type", None)
        if not model_type:
            raise ValueError(f"{str(source)!r} has no 'model_type'; cannot tell which model it configures.")
        try:
            config_cls = type(transformers.AutoConfig.for_model(model_type))
        except ValueError:
            raise ValueError(
                f"{str(source)!r}: model_type {model_type!r} is unknown to transformers {transformers.__version__}."
            ) from None
    else:
        config_cls = getattr(transformers, source, None)
        if not (isinstance(config_cls, type) and issubclass(config_cls, transformers.PretrainedConfig)):
            raise ValueError(f"transformers has no config class {source!r}. MODEL is {MODEL_SPEC_HELP}.")
    # Configs accept any keyword silently, so a typo would plan the default model: refuse it.
    known = set(config_cls().to_dict())
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{config_cls.__name__} has no field(s) {', '.join(map(repr, unknown))}.")
    # Overrides go through __init__: derived fields (head_dim, ...) are computed there.
    config = config_cls(**{**fields, **overrides})
    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise ValueError(f"building a causal LM from {config_cls.__name__} failed: {type(e).__name__}: {e}") from e

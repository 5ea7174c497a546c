"""What every multi-rank test worker shares: the case registry, data slicing, comparisons, main().

A worker script defines ``CASES = Cases()``, decorates plain functions with ``@CASES.case`` (each
raises on failure), and ends with ``run_cases(CASES)``. ``conftest.run_dist`` launches it with
torchrun; every rank writes ``{case: "ok" | traceback}`` to ``--out``/rank{N}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from torch.distributed.tensor import DTensor  # noqa: E402

from examples.gpt import GPTConfig  # noqa: E402
from zeta_fsdp import shutdown  # noqa: E402

GLOBAL_BATCH, SEQ = 8, 11
ARGS = argparse.Namespace()  # the worker's parsed command line, for cases that need extra arguments


class Cases(dict):
    """name -> case function; ``@cases.case`` registers one."""

    def case(self, fn: Callable[[], None]) -> Callable[[], None]:
        self[fn.__name__] = fn
        return fn


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def global_batch(
    step: int, cfg: Optional[GPTConfig] = None, batch: int = GLOBAL_BATCH
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (inputs, targets) on every rank for a given step: the reference's global batch."""
    cfg = cfg or GPTConfig()
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def local_slice(t: torch.Tensor, ranks: Optional[int] = None, index: Optional[int] = None) -> torch.Tensor:
    """This rank's contiguous share of a global batch (``ranks``/``index`` default to the world)."""
    ranks = world() if ranks is None else ranks
    index = rank() if index is None else index
    per = t.shape[0] // ranks
    return t[index * per : (index + 1) * per]


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    err = (full(got).detach().float() - full(want).detach().float()).abs().max().item()
    assert err <= atol, f"{name}: max abs diff {err:.3e} > {atol:.0e}"


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().clone()
    dist.all_reduce(x)
    return x / world()


def run_cases(
    cases: Cases, extra_args: Optional[Callable[[argparse.ArgumentParser], None]] = None
) -> argparse.Namespace:
    """Parse ``--out``/``--cases``, run the cases on this rank, write results, leave cleanly."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    if extra_args is not None:
        extra_args(parser)
    args = parser.parse_args(namespace=ARGS)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # A short timeout: a case failing on one rank must not hang its peers for 30 minutes.
    timeout = timedelta(seconds=int(os.environ.get("ZETA_TEST_TIMEOUT", 120)))
    dist.init_process_group("gloo", timeout=timeout)
    results = {}
    for name in args.cases.split(","):
        try:
            cases[name]()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank()}.json").write_text(json.dumps(results))
    shutdown(force=True)
    return args

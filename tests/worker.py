"""What every multi-rank test worker shares: the case registry, data slicing, comparisons, main().

A worker script defines ``CASES = Cases()``, decorates plain functions with ``@CASES.case`` (each
raises on failure), and ends with ``run_cases(CASES)``. ``conftest.run_dist`` launches it with
torchrun; every rank writes ``{case: "ok" | traceback}`` to ``--out``/rank{N}.json (a case that
returns a value, such as a measurement, writes that value instead of ``"ok"``). Started with plain
``python`` (no torchrun), a worker runs as one rank in the one-process group ``fsdp()`` uses in a
notebook.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from torch.distributed.tensor import DTensor  # noqa: E402

from zeta_fsdp import shutdown  # noqa: E402
from zeta_fsdp.distributed import ensure_process_group  # noqa: E402
from zeta_fsdp.models.gpt import GPTConfig  # noqa: E402

GLOBAL_BATCH, SEQ, VOCAB = 8, 11, GPTConfig().vocab_size
ARGS = argparse.Namespace()  # the worker's parsed command line, for cases that need extra arguments


class Cases(dict):
    """name -> case function; ``@cases.case`` registers one."""

    def case(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        self[fn.__name__] = fn
        return fn


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def tokens(n: int, seed: int, vocab: int = VOCAB, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random (inputs, targets) sequences drawn from ``seed``: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def global_batch(
    step: int, cfg: Optional[GPTConfig] = None, batch: int = GLOBAL_BATCH
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (inputs, targets) on every rank for a given step: the reference's global batch."""
    return tokens(batch, 1000 + step, (cfg or GPTConfig()).vocab_size)


def local_slice(t: torch.Tensor, ranks: Optional[int] = None, index: Optional[int] = None) -> torch.Tensor:
    """This rank's contiguous share of a global batch (``ranks``/``index`` default to the world)."""
    ranks = world() if ranks is None else ranks
    index = rank() if index is None else index
    per = t.shape[0] // ranks
    return t[index * per : (index + 1) * per]


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    """Max abs difference (exact: taken in float64) at most ``atol``; either side may be a DTensor."""
    err = (full(got).detach().double() - full(want).detach().double()).abs().max().item()
    assert err <= atol, f"{name}: max abs diff {err:.3e} > {atol:.0e}"


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().clone()
    dist.all_reduce(x)
    return x / world()


def expect_error(exc_type: type, fn: Callable[[], Any], *needles: str) -> str:
    """``fn()`` raises ``exc_type`` with every needle in its message; returns the message."""
    try:
        fn()
    except exc_type as e:
        message = str(e)
        for needle in needles:
            assert needle in message, f"{exc_type.__name__} message lacks {needle!r}: {message}"
        return message
    raise AssertionError(f"{exc_type.__name__} was not raised (expected one mentioning {needles})")


def run_cases(
    cases: Cases,
    extra_args: Optional[Callable[[argparse.ArgumentParser], None]] = None,
    after_results: Optional[Callable[[], None]] = None,
) -> argparse.Namespace:
    """Parse ``--out``/``--cases``, run the cases on this rank, write results, leave cleanly.

    ``extra_args(parser)`` adds the worker's own arguments (read them from ``ARGS``);
    ``after_results()`` runs once the results are written, before the process group is shut down.
    """
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
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=timeout)
    else:  # started with plain `python`: one rank, the group fsdp() would start in a notebook
        ensure_process_group(torch.device("cpu"))
    results: dict[str, Any] = {}
    for name in [c for c in args.cases.split(",") if c]:
        try:
            value = cases[name]()
            results[name] = "ok" if value is None else value
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank()}.json").write_text(json.dumps(results))
    if after_results is not None:
        after_results()
    shutdown(force=True)
    return args

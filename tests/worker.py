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
    """name -> case function; ``@cases.case`` registers one (on 2 ranks), ``@cases.case(ranks=4)`` on 4.

    The test modules collect their cases from here (``conftest.dist_test``): a case is named once.
    ``group`` sorts cases that need a launch of their own (extra arguments, shared files) apart.
    """

    def case(self, fn: Optional[Callable[[], Any]] = None, *, ranks: Any = 2, group: str = "") -> Any:
        """Register ``fn`` for ``ranks`` ranks (an int, or a tuple: the case runs at each size)."""

        def register(f: Callable[[], Any]) -> Callable[[], Any]:
            f.ranks, f.group = (ranks,) if isinstance(ranks, int) else tuple(ranks), group
            self[f.__name__] = f
            return f

        return register(fn) if fn is not None else register

    def names(self, ranks: int, group: str = "") -> list[str]:
        """The cases registered for ``ranks`` ranks in ``group``, in file order."""
        return [n for n, f in self.items() if ranks in getattr(f, "ranks", (2,)) and getattr(f, "group", "") == group]


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


def _add(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return b if a is None else a if b is None else a + b


def reference_backward(
    ref: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    ranks: Optional[int] = None,
    replicas: int = 1,
    micro_batches: int = 1,
) -> torch.Tensor:
    """The gradient FSDP computes for the global batch ``(x, y)`` on ``ranks`` ranks, bit for bit.

    Each rank-sized chunk gets its own forward, mean loss and gradient (the same shapes, hence
    the same kernels and rounding, as on the rank), and the chunks' gradients are averaged the
    way FSDP's collectives average them: within each shard group, then across ``replicas``
    (HSDP's ``(replicas, ranks // replicas)`` mesh). Every level of that tree has two members at
    2 ranks and at 2x2, where a sum of two is exact in any order: fp32 parity is then exact on
    every CPU. Gradients are added to ``.grad``. ``micro_batches=k`` splits the batch into ``k``
    consecutive micro-batches whose chunk gradients each rank accumulates in order before the one
    reduction (``no_sync`` accumulation); ``loss_fn`` scales them as the ranks do. Returns the
    loss ``mean_over_ranks`` gives (the mean of the chunks' losses; of the last micro-batch).

    Example:
        >>> loss = reference_backward(ref, lm_loss, *global_batch(0))  # doctest: +SKIP
    """
    ranks = world() if ranks is None else ranks
    params = [p for p in ref.parameters() if p.requires_grad]
    per_micro = x.shape[0] // micro_batches
    losses, grads = [], []
    for r in range(ranks):
        accumulated = None
        for i in range(micro_batches):
            xi, yi = x[i * per_micro : (i + 1) * per_micro], y[i * per_micro : (i + 1) * per_micro]
            loss = loss_fn(ref(local_slice(xi, ranks, r)), local_slice(yi, ranks, r))
            g = torch.autograd.grad(loss, params, allow_unused=True)
            accumulated = g if accumulated is None else [_add(a, b) for a, b in zip(accumulated, g)]
        losses.append(loss.detach())
        grads.append(accumulated)

    def average(items: list) -> Any:
        total = items[0]
        for item in items[1:]:
            total = total + item
        return total / len(items)

    per_group = ranks // replicas
    for i, p in enumerate(params):
        if all(g[i] is None for g in grads):
            continue  # used by no chunk: no gradient, as FSDP and DDP leave it (optimizers skip it)
        chunk_grads = [g[i] if g[i] is not None else torch.zeros_like(p) for g in grads]
        groups = [average(chunk_grads[k * per_group : (k + 1) * per_group]) for k in range(replicas)]
        g = average(groups)
        p.grad = g if p.grad is None else p.grad + g
    return average(losses)  # in rank order, as mean_over_ranks sums the ranks' losses


def deferred_all_reduce_reference(
    ref: torch.nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor, k: int, replicas: int
) -> None:
    """The gradient FSDP2 computes with ``no_sync(defer="all_reduce")``, bit for bit, into ``ref``.

    Each micro-batch is reduced within each shard group (``reference_backward`` on the replica's
    slice: one chunk per shard rank, averaged), the reduced micro-batches are summed in order (FSDP2
    adds each reduce-scatter output into one sharded buffer, the last one plus that buffer: a sum of
    the same terms in the same order, since a + b == b + a), then averaged over the replicas. This is
    not ``reference_backward(micro_batches=k)``, which sums each rank's micro-batches *before* the
    shard-group mean: the two orders can differ by roundings, so the test uses FSDP2's own order. A
    parameter no chunk used stays ``None``; ``loss_fn`` scales each micro-batch's loss as the ranks do.
    """
    params = list(ref.parameters())
    shard, per = world() // replicas, x.shape[0] // k
    finals = []
    for replica in range(replicas):
        total: list = [None] * len(params)
        for i in range(k):
            for p in params:
                p.grad = None
            xi, yi = (local_slice(t[i * per : (i + 1) * per], replicas, replica) for t in (x, y))
            reference_backward(ref, loss_fn, xi, yi, ranks=shard)
            total = [g if t is None else t if g is None else t + g for t, g in zip(total, (p.grad for p in params))]
        finals.append(total)
    for j, p in enumerate(params):
        grads = [f[j] for f in finals]
        if all(g is None for g in grads):
            p.grad = None
            continue
        grads = [torch.zeros_like(p) if g is None else g for g in grads]
        summed = grads[0]
        for g in grads[1:]:
            summed = summed + g
        p.grad = summed / replicas


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    """Max abs difference (exact: taken in float64) at most ``atol``; either side may be a DTensor."""
    err = (full(got).detach().double() - full(want).detach().double()).abs().max().item()
    assert err <= atol, f"{name}: max abs diff {err:.3e} > {atol:.0e}"


UNIT_ROUNDOFF = 2.0**-24  # fp32: the relative error of one rounding


def assert_close_scaled(name: str, got: torch.Tensor, want: torch.Tensor, ulps: float) -> None:
    """Max abs difference at most ``ulps`` roundings of ``want``'s largest element.

    For values the two sides compute by the same formula but grouped differently (a batch split
    over ranks, a norm summed over shards): the difference is a sum of roundings, each bounded by
    the unit roundoff times the magnitudes involved, whatever SIMD kernels the CPU has.
    """
    scale = max(full(want).detach().abs().max().item(), 1e-30)
    assert_close(name, got, want, ulps * UNIT_ROUNDOFF * scale)


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The mean of ``x`` over ranks, summed in rank order (as ``reference_backward`` sums losses).

    An all-gather, not an all-reduce: the all-reduce's summation order is the backend's own, and
    a fixed order makes the loss comparison exact at any world size.
    """
    shape, x = x.shape, x.detach().reshape(-1).clone()
    gathered = [torch.empty_like(x) for _ in range(world())]
    dist.all_gather(gathered, x)
    total = gathered[0]
    for item in gathered[1:]:
        total = total + item
    return (total / world()).reshape(shape)


def assert_losses_match(loss: torch.Tensor, ref_losses: list, step: int, tol: float = 0.0) -> None:
    """Every rank's ``loss`` equals the reference's loss for that rank's slice (within ``tol``)."""
    losses = [torch.empty_like(loss.detach()) for _ in range(world())]
    dist.all_gather(losses, loss.detach())
    for r in range(world()):
        err = (losses[r].double() - ref_losses[r].double()).abs().item()
        assert err <= tol, f"step {step} rank {r}: loss {losses[r]} != {ref_losses[r]} (diff {err:.3e})"


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


NOT_RUN = "NOT RUN"  # prefix of the result of a case a launch stopped before (the harness relaunches it)
# How long a rank whose case failed waits for its peers to finish that case. A peer still inside
# the case is waiting in a collective for this rank and never will: past this, the launch aborts.
FAIL_GRACE_S = float(os.environ.get("ZETA_TEST_FAIL_GRACE", 5))


def _write_results(out: Path, results: dict[str, Any]) -> None:
    """Rewrite this rank's results file after every case: a rank that dies later still reported."""
    tmp = out / f".rank{rank()}.json.tmp"
    tmp.write_text(json.dumps(results))
    os.replace(tmp, out / f"rank{rank()}.json")


def _agree(store: dist.Store, index: int, ok: bool, timeout_s: float) -> bool:
    """Every rank says how case ``index`` went; False when the launch must stop here.

    The statuses travel through the rendezvous store, not a collective: a rank that failed
    between two collectives must not pair this exchange with a peer's pending collective.
    A rank that passed waits as long as any collective would; a rank that failed waits
    ``FAIL_GRACE_S`` and, if a peer is still inside the case, aborts the launch. Its exit then
    breaks the peer's pending collective at once (gloo sees the closed connection), the peer
    records its own error for the case, and every rank leaves; the harness relaunches the
    cases not yet run.
    """
    prefix = f"zeta_test/case{index}"
    store.set(f"{prefix}/rank{rank()}", "ok" if ok else "fail")
    keys = [f"{prefix}/rank{r}" for r in range(world())]
    try:
        store.wait(keys, timedelta(seconds=timeout_s if ok else FAIL_GRACE_S))
    except Exception:  # a peer is stuck in the case (or gone): stop the launch
        store.set("zeta_test/aborted", str(rank()))
        return False
    return not store.check(["zeta_test/aborted"])


def run_cases(
    cases: Cases,
    extra_args: Optional[Callable[[argparse.ArgumentParser], None]] = None,
    after_results: Optional[Callable[[], None]] = None,
) -> argparse.Namespace:
    """Parse ``--out``/``--cases``, run the cases on this rank, write results, leave cleanly.

    Each case's result is written as soon as it is known. After each case the ranks agree
    (``_agree``) before any rank starts the next one, so a case failing on one rank fails fast on
    every rank with its own traceback, and never hangs its peers until the collective timeout.
    ``extra_args(parser)`` adds the worker's own arguments (read them from ``ARGS``);
    ``after_results()`` runs once all results are written, before the process group is shut down.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    if extra_args is not None:
        extra_args(parser)
    args = parser.parse_args(namespace=ARGS)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # The backstop for a hang the agreement cannot see (a peer that never reaches its case).
    timeout = timedelta(seconds=int(os.environ.get("ZETA_TEST_TIMEOUT", 120)))
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=timeout)
    else:  # started with plain `python`: one rank, the group fsdp() would start in a notebook
        ensure_process_group(torch.device("cpu"))
    store = dist.distributed_c10d._get_default_store() if world() > 1 else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [c for c in args.cases.split(",") if c]
    results: dict[str, Any] = {}
    for index, name in enumerate(names):
        try:
            value = cases[name]()
            results[name], ok = ("ok" if value is None else value), True
        except Exception:
            results[name], ok = traceback.format_exc(), False
        _write_results(out, results)
        if store is not None and not _agree(store, index, ok, timeout.total_seconds()):
            for rest in names[index + 1 :]:
                results[rest] = f"{NOT_RUN}: the launch stopped after {name!r} failed"
            _write_results(out, results)
            sys.stdout.flush()
            sys.stderr.flush()
            # No shutdown: the group is broken. Leaving closes this rank's connections, which is
            # what releases a peer still waiting in the failed case's collective.
            os._exit(0)
    if after_results is not None:
        after_results()
    shutdown(force=True)
    return args

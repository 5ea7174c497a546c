"""Weights out while training: ``iter_full_weights`` on real gloo ranks (see ``tests/test_weights_out.py``).

The reference is ``get_full_state_dict(model, rank0_only=False)``: the same shards gathered one tensor at a
time. A stream only copies bytes (and casts, elementwise), so every tensor must be equal bit for bit; a merged
LoRA weight is compared with PEFT's own ``merge_and_unload()`` of an unsharded copy holding the same weights
(the same matmul on the same full tensors), Hugging Face names with transformers' own ``save_pretrained``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor.debug import CommDebugMode
from worker import ARGS, Cases, expect_error, rank, run_cases, world

from zeta_fsdp import fsdp, get_full_state_dict
from zeta_fsdp.weights_out import StreamError, broadcasts, gather, iter_full_weights

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
CASES = Cases()
case = CASES.case


class Odd(nn.Module):
    """Dim-0 sizes that do not split evenly over 2 or 4 ranks (padding), a tie, a buffer, a frozen tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(13, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 7), nn.GELU(), nn.Linear(7, 6)) for _ in range(3))
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.embed.weight
        self.tiny = nn.Linear(6, 1)  # one row: the second rank's shard is empty
        self.register_buffer("scale", torch.arange(5, dtype=torch.float32))
        self.blocks[0][0].requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = x + b(x)
        return self.head(self.norm(x)) + self.tiny(x)


def wrapped(model: nn.Module = None, **kw) -> nn.Module:
    model = model or Odd()
    kw.setdefault("shard_strat", "FULL_SHARD")
    kw.setdefault("auto_wrap", True)
    if isinstance(model, Odd):
        kw.setdefault("TransformerBlock", nn.Sequential)
    return fsdp(model, **kw)


def collect(stream) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for bucket in stream:
        for name, t in bucket:
            assert name not in out, f"{name} streamed twice"
            out[name] = t
    return out


def assert_same(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want) or set(got) == set(want), f"{what}: names {sorted(set(got) ^ set(want))} differ"
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{what}: {k} {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
        )
        assert torch.equal(g.view(-1).view(torch.uint8), w.contiguous().view(-1).view(torch.uint8)), (
            f"{what}: {k} differs"
        )


def gathers(counts) -> int:
    return sum(n for op, n in counts.items() if "allgather" in str(op))


def broadcasts_of(stream) -> int:
    """The broadcasts a stream's plan asks for: one per rank holding rows of each source moved by broadcasts."""
    n = 0
    for b in stream.buckets:
        moved = broadcasts.broadcast_slots(b, {}, torch.device("cpu")) if b.gathers else {}
        n += sum(s.rows_of(r) > 0 for i in b.items for s in i.sources if s.key in moved for r in range(s.shards))
    return n


@contextlib.contextmanager
def every_tensor_by_broadcasts():
    """Every plain sharded tensor moved by broadcasts (on CPU only large ones are, by default)."""
    saved, broadcasts.BROADCAST_MIN_BYTES = broadcasts.BROADCAST_MIN_BYTES, 0
    try:
        yield
    finally:
        broadcasts.BROADCAST_MIN_BYTES = saved


def check_strategy(shard_strat: str, model: nn.Module = None, **kw) -> None:
    model = model or wrapped(shard_strat=shard_strat, **kw)
    want = get_full_state_dict(model, rank0_only=False)
    largest = max(t.numel() * t.element_size() for t in want.values())
    for mb in (1.0, largest / 3 / 2**20):  # one bucket; buckets smaller than the largest tensor
        stream = iter_full_weights(model, bucket_mb=mb)
        with CommDebugMode() as comm:
            got = collect(stream)
        assert_same(got, want, f"{shard_strat} bucket_mb={mb:.5f}")
        assert got["head.weight"] is got["embed.weight"], "a tied alias is the same tensor"
        expected, sent = sum(b.gathers for b in stream.buckets), broadcasts_of(stream)
        # one flat all-gather per bucket with shards, plus the 1 KiB closing exchange (every rank's status), plus
        # the broadcasts of the large tensors on CPU (none in these small models unless every_tensor_by_broadcasts)
        assert gathers(comm.get_comm_counts()) == expected + 1, (comm.get_comm_counts(), expected)
        assert sum(comm.get_comm_counts().values()) == expected + 1 + sent, (comm.get_comm_counts(), sent)
        if broadcasts.BROADCAST_MIN_BYTES == 0 and shard_strat != "NO_SHARD":
            assert sent > len(stream.buckets), "the broadcast path was taken"
        if shard_strat == "NO_SHARD":
            assert expected == 0, "NO_SHARD has nothing to gather"
        elif shard_strat == "HYBRID_SHARD":  # 2x2 mesh: gathered over the 2 ranks of the shard dim, not all 4
            assert {b.shards for b in stream.buckets if b.gathers} == {2}, [b.shards for b in stream.buckets]
        if shard_strat != "NO_SHARD":  # every parameter in one bucket, or split over several below the largest tensor
            assert len(stream.buckets) == 1 if mb >= 1 else expected > 3, (mb, expected, len(stream.buckets))


@case
def full_shard_equals_get_full_state_dict():
    check_strategy("FULL_SHARD")
    # The path of NCCL and the backends without a coalesced all-gather of lists (one flat all-gather, copied out)
    saved, gather.COALESCED_DEVICES = gather.COALESCED_DEVICES, set()
    try:
        check_strategy("FULL_SHARD")
    finally:
        gather.COALESCED_DEVICES = saved


@case
def broadcast_path_equals_get_full_state_dict_and_fails_alike():
    # CPU: each rank's rows of a large tensor broadcast into place (here every tensor, uneven and empty shards too)
    with every_tensor_by_broadcasts():
        check_strategy("FULL_SHARD")
        shard_grad_op_equals_get_full_state_dict()
        bf16_compute_with_a_dtype_cast()
        ranks_keep_only_where_asked_and_stream_moves_on_while_consumer_works()
        step_mid_stream_raises_and_forward_mid_stream_is_harmless()
        failure_on_one_rank_reaches_every_rank_fast()
        peak_memory_is_two_buckets_and_one_tensor()


@case
def shard_grad_op_equals_get_full_state_dict():
    model = wrapped(shard_strat="SHARD_GRAD_OP")
    model(torch.randint(0, 13, (2, 3))).sum().backward()  # parameters left unsharded by the forward
    check_strategy("SHARD_GRAD_OP", model)


@case
def no_shard_has_nothing_to_gather():
    check_strategy("NO_SHARD")


@case(ranks=4)
def hybrid_shard_gathers_along_the_shard_dim_only():
    check_strategy("HYBRID_SHARD", replicate_size=2)
    with every_tensor_by_broadcasts():  # the broadcasts' source ranks are the shard group's, not 0..1
        check_strategy("HYBRID_SHARD", replicate_size=2)


@case
def bf16_compute_with_a_dtype_cast():
    model = wrapped(mp="bf16")
    model(torch.randint(0, 13, (2, 3))).sum().backward()
    want = {k: v.to(torch.bfloat16) for k, v in get_full_state_dict(model, rank0_only=False).items()}
    stream = iter_full_weights(model, bucket_mb=0.001, dtype=torch.bfloat16, device="compute")
    got = collect(stream)
    assert_same(got, want, "bf16")
    # the shards travel in bf16: half of fp32's bytes per rank segment
    assert all(s.dtype == torch.bfloat16 for b in stream.buckets for i in b.items for s in i.sources)


@case
def ranks_keep_only_where_asked_and_stream_moves_on_while_consumer_works():
    model = wrapped()
    want = get_full_state_dict(model, rank0_only=False)
    got = {}
    for bucket in iter_full_weights(model, bucket_mb=0.0005, ranks=[1]):
        if rank() == 1:
            got.update(bucket)
            assert bucket.flat is not None and all(
                t.untyped_storage().data_ptr() == bucket.flat.data_ptr() for _, t in bucket
            )
        else:
            assert list(bucket) == [] and bucket.flat is None
    if rank() == 1:
        assert_same(got, want, "ranks=[1]")


@case
def step_mid_stream_raises_and_forward_mid_stream_is_harmless():
    model = wrapped()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    want = get_full_state_dict(model, rank0_only=False)
    got = {}
    stream = iter_full_weights(model, bucket_mb=0.0005)
    for i, bucket in enumerate(stream):
        got.update(bucket)
        if i == 1:  # a forward and backward between buckets: the streamed shards do not change
            model(torch.randint(0, 13, (2, 3))).sum().backward()
            expect_error(StreamError, opt.step, "optimizer.step() while iter_full_weights()", "close()")
    assert_same(got, want, "forward mid-stream")
    opt.step()  # the stream is over: stepping is allowed again
    stream = iter_full_weights(model, bucket_mb=0.0005)
    next(stream)
    stream.close()  # on every rank: ends quietly
    opt.step()
    after = get_full_state_dict(model, rank0_only=False)
    assert not torch.equal(after["tiny.weight"], want["tiny.weight"])


@case
def failure_on_one_rank_reaches_every_rank_fast():
    model = wrapped()
    start = time.monotonic()

    def run() -> None:
        with iter_full_weights(model, bucket_mb=0.0005) as stream:
            for i, _ in enumerate(stream):
                if i == 2 and rank() == 1:
                    raise KeyError("the consumer on rank 1 broke")

    if rank() == 1:
        expect_error(KeyError, run, "the consumer on rank 1 broke")
    else:
        expect_error(StreamError, run, "rank 1 failed", "KeyError", "the consumer on rank 1 broke")
    assert time.monotonic() - start < 20, "every rank raised within seconds, not at the process group's timeout"
    # a rank that stops early without an error: the others are told, not left waiting
    stream = iter_full_weights(model, bucket_mb=0.0005)
    next(stream)
    # rank 1 is told at its next bucket; rank 0 learns at the closing exchange that rank 1 could not finish
    stop = stream.close if rank() == 0 else (lambda: collect(stream))
    expect_error(StreamError, stop, "rank 0 stopped iterating before the end")
    bare_loop_left_with_break_ends_on_every_rank(model)


def bare_loop_left_with_break_ends_on_every_rank(model: nn.Module) -> None:
    """``break`` out of a bare ``for bucket in iter_full_weights(...)`` (no ``with``, no ``close()``): the dropped
    stream tells its peers at once; they raise StreamError in seconds (rank 0 gets their error as a warning)."""

    def bare(stop_on: set, at: int = 1, model: nn.Module = model) -> None:
        for i, _ in enumerate(iter_full_weights(model, bucket_mb=0.0005)):
            if i == at and rank() in stop_on:
                break

    start = time.monotonic()
    if rank() == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bare({0})
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert any("rank 0 stopped iterating before the end" in m for m in said), said
    else:
        expect_error(StreamError, lambda: bare({0}), "rank 0 stopped iterating before the end")
    assert time.monotonic() - start < 20, "the peers learned of the break within seconds"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bare({0, 1})  # every rank leaving at the same bucket: on purpose, quietly
        # At different buckets the later rank learns in the bucket in flight and starts no bucket more (a bucket
        # the earlier rank never joins would meet its closing exchange: gloo aborts on the size mismatch).
        chain = fsdp(nn.Sequential(*[nn.Linear(12, 10) for _ in range(5)]), shard_strat="FULL_SHARD")
        bare({0, 1}, at=1 + rank(), model=chain)
        stream = iter_full_weights(chain, bucket_mb=0.0005)
        for i, _ in enumerate(stream):
            if i == 1 + rank():
                stream.close()
                break
        assert_same(collect(iter_full_weights(chain)), get_full_state_dict(chain, rank0_only=False), "chain")
        # a rank leaving at the last bucket got every bucket: the stream is complete, nobody raises or warns
        last = len(list(iter_full_weights(chain, bucket_mb=0.0005))) - 1
        bare({1}, at=last, model=chain)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    assert_same(collect(iter_full_weights(model)), get_full_state_dict(model, rank0_only=False), "after the breaks")


@case
def bad_arguments_and_meta_models_are_refused_on_every_rank():
    model = wrapped()
    expect_error(ValueError, lambda: iter_full_weights(model, names="vllm"), "names='vllm'", "'model', 'hf'")
    expect_error(ValueError, lambda: iter_full_weights(model, bucket_mb=0), "bucket_mb=0")
    expect_error(ValueError, lambda: iter_full_weights(model, dtype=torch.int8), "dtype=torch.int8")
    expect_error(ValueError, lambda: iter_full_weights(model, ranks=[5]), "ranks=[5]")
    expect_error(ValueError, lambda: iter_full_weights(model, lora="adapters"), "needs a PEFT model")
    expect_error(ValueError, lambda: iter_full_weights(model, names="hf"), "names='hf' needs a Hugging Face")
    uneven = lambda: iter_full_weights(model, bucket_mb=0.001 if rank() == 0 else 1)  # noqa: E731
    expect_error(StreamError, uneven, "the ranks planned different buckets", "layout digests per rank")
    with torch.device("meta"):
        meta = Odd()
    meta = fsdp(meta, auto_wrap=True, TransformerBlock=nn.Sequential, shard_strat="FULL_SHARD", materialize=False)
    expect_error(ValueError, lambda: iter_full_weights(meta), "meta device")


@case
def peak_memory_is_two_buckets_and_one_tensor():
    torch.manual_seed(0)
    model = wrapped(nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]), auto_wrap=False)
    want = get_full_state_dict(model, rank0_only=False)
    largest = max(t.numel() * t.element_size() for t in want.values())
    results = {}
    for cap in (largest // 2, 2 * largest, 5 * largest):
        stream = iter_full_weights(model, bucket_mb=cap / 2**20)
        bucket_bytes = max(b.output_bytes for b in stream.buckets)
        # gloo's all-gather buffer (C++, unseen by MemTracker): a bucket's bytes plus each rank's 1 KiB header and padding
        gathered = max(b.shards * b.segment_bytes for b in stream.buckets)
        assert gathered <= bucket_bytes + world() * (1024 + 64 * len(stream.buckets[0].items)), gathered
        tracker = MemTracker()
        tracker.track_external(model)  # the shards the stream sends as they are: views of the model, not new memory
        seen = set()
        with tracker:  # the consumer checks each tensor and keeps nothing: the peak is the stream's own
            before = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
            for bucket in stream:
                for name, t in bucket:
                    assert torch.equal(t, want[name]), name
                    seen.add(name)
                del bucket, t
        assert seen == set(want)
        extra = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - before
        assert bucket_bytes <= extra <= gathered + bucket_bytes + largest, (cap, extra, gathered, bucket_bytes, largest)
        results[cap] = extra
    print(f"weights_out peak extra bytes by bucket cap: {results} (largest tensor {largest})")


def lora_model():
    from peft_cases import lora_llama

    return lora_llama()


@case
def peft_lora_merged_and_adapters_only():
    model = lora_model()
    ref = copy.deepcopy(model)
    wrapped_model = fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
    full = get_full_state_dict(wrapped_model, rank0_only=False)
    ref.load_state_dict(full)
    adapters = {k: v for k, v in full.items() if "lora_" in k}
    merged = ref.merge_and_unload().state_dict()
    got = collect(iter_full_weights(wrapped_model, bucket_mb=0.01))
    assert_same(got, merged, "lora merged")
    got = collect(iter_full_weights(wrapped_model, bucket_mb=0.001, lora="adapters"))
    want = {k.replace(".default", ""): v for k, v in adapters.items()}
    assert_same(got, want, "lora adapters")
    got = collect(iter_full_weights(wrapped_model, lora="merged", dtype=torch.bfloat16, names="hf"))
    assert_same(got, {k: v.to(torch.bfloat16) for k, v in merged.items()}, "lora merged, HF names, bf16")


@case
def hf_mixtral_streams_save_pretrained_names():
    import transformers as T
    from safetensors.torch import load_file

    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = T.MixtralConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=40, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = T.MixtralForCausalLM(cfg)
    ref = copy.deepcopy(model)
    model = fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD")
    ref.load_state_dict(get_full_state_dict(model, rank0_only=False))
    out = os.path.join(ARGS.out, "mixtral_ref")
    if rank() == 0:  # transformers writes on the main rank only
        ref.save_pretrained(out)
    dist.barrier()
    want = load_file(os.path.join(out, "model.safetensors"))
    assert any(".experts.0.w1.weight" in k for k in want), "transformers saves per-expert weights"
    got = collect(iter_full_weights(model, names="hf", bucket_mb=0.005))
    assert_same(got, want, "mixtral HF names")
    assert "lm_head.weight" not in got, "a tied weight is streamed once"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_receiver(*flags: str):
    """Rank 0 starts a receiver process (``weights_receiver.py``) and joins the weights group with it."""
    import subprocess
    import sys

    if rank() != 0:
        return None, None, None
    from zeta_fsdp.weights_out import weights_group

    address = f"127.0.0.1:{free_port()}"
    out = os.path.join(ARGS.out, f"received_{'_'.join(f.strip('-') for f in flags) or 'plain'}.pt")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights_receiver.py")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    proc = subprocess.Popen(
        [sys.executable, script, address, out, *flags],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return weights_group(address, rank=0, world_size=2, timeout_s=30), proc, out


@case
def receiver_process_gets_the_same_bytes():
    from zeta_fsdp.weights_out import send_weights

    model = wrapped()
    want = get_full_state_dict(model, rank0_only=False)
    group, proc, out = start_receiver()
    sent = send_weights(model, group, bucket_mb=0.0005, timeout_s=30)
    if rank() == 0:
        assert proc.wait(timeout=60) == 0, proc.stdout.read()[-3000:]
        got = torch.load(out, weights_only=True)
        assert_same(got, want, "receiver")
        assert sent >= sum(t.numel() * t.element_size() for k, t in want.items() if k != "head.weight"), sent
    else:
        assert sent == 0


@case
def receiver_whose_model_differs_fails_every_rank_with_one_error():
    from zeta_fsdp.weights_out import send_weights

    model = wrapped()
    group, proc, _ = start_receiver("--wrong-shape")
    dist.barrier()  # the clock starts once the receiver is up (rank 0 waited for it in weights_group)
    start = time.monotonic()
    expect_error(
        StreamError,
        lambda: send_weights(model, group, timeout_s=30),
        "receiver 1 failed",
        "tiny.weight: sent [1, 6], model [2, 6]",
    )
    elapsed = time.monotonic() - start
    assert elapsed < 20, f"the trainer ranks raised after {elapsed:.1f} s"
    if rank() == 0:
        assert proc.wait(timeout=60) != 0
        assert "tiny.weight: sent [1, 6], model [2, 6]" in proc.stdout.read()


@case
def receiver_dying_mid_stream_makes_every_trainer_rank_raise_fast():
    from zeta_fsdp.weights_out import send_weights

    model = wrapped()
    group, proc, _ = start_receiver("--die-after-bucket", "1")
    dist.barrier()  # the clock starts once the receiver is up (rank 0 waited for it in weights_group)
    start = time.monotonic()
    expect_error(StreamError, lambda: send_weights(model, group, bucket_mb=0.0005, timeout_s=30), "failed")
    elapsed = time.monotonic() - start
    assert elapsed < 20, f"the trainer ranks raised after {elapsed:.1f} s"
    if rank() == 0:
        assert proc.wait(timeout=60) == 3


if __name__ == "__main__":
    run_cases(CASES)

"""Hugging Face weights in and out of sharded models, on real gloo ranks (see ``tests/test_hf.py``).

Each architecture is a tiny config (no download). The reference is the unsharded model built
with a fixed seed (the same on every rank); rank 0 writes it with transformers' own
``save_pretrained``. Weights must come back bit-exact (a load or save only copies, casts and
re-lays out bytes: no arithmetic), and so must the sharded model's outputs: its forward runs the
same kernels on the same full (all-gathered) fp32 weights and the same inputs as the reference.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from worker import ARGS, Cases, expect_error, full, rank, run_cases, world
from zoo_models import HF, IMAGE, SEQ, VOCAB

from zeta_fsdp import consolidate_to_hf, fsdp, load_pretrained, save_checkpoint, save_pretrained
from zeta_fsdp.hf.files import INDEX_NAME
from zeta_fsdp.state_dict import CheckpointError

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
import transformers as T  # noqa: E402

T.logging.set_verbosity_error()
T.utils.logging.disable_progress_bar()

CASES = Cases()
case = CASES.case
STRATS = {
    "FULL_SHARD": {"shard_strat": "FULL_SHARD"},
    "SHARD_GRAD": {"shard_strat": "SHARD_GRAD"},
    "NO_SHARD": {"shard_strat": "NO_SHARD"},
    "HYBRID_SHARD": {"shard_strat": "HYBRID_SHARD", "replicate_size": 2},
}
# The tests' tiny configs (one home, shared with the parity zoo): name -> (model class, Auto class, config).
ARCHS = {name: arch.classes for name, arch in HF.items() if name != "wav2vec2"}
ZOO = [a for a in ARCHS if a not in ("clip", "llama_uneven")]


def build(arch: str, seed: int = 0, meta: bool = False) -> torch.nn.Module:
    cls, _, cfg = ARCHS[arch]()
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return cls(cfg).eval()
    return cls(cfg).eval()


def inputs(arch: str) -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=g)
    if arch == "vit":
        return {"pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=g)}
    if arch == "clip":
        return {"input_ids": ids, "pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=g)}
    if arch in ("t5", "bart"):
        return {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    return {"input_ids": ids}


def outputs(model: torch.nn.Module, arch: str) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs(arch))
    return out.logits_per_image if arch == "clip" else out.logits


def work() -> Path:
    d = Path(ARGS.out) / "work"
    d.mkdir(parents=True, exist_ok=True)  # no barrier: rank-0-only checks call this too
    return d


def on_rank0(fn) -> None:
    """Run ``fn`` on rank 0 only; every rank raises if it failed (collectives stay paired)."""
    error = [None]
    if rank() == 0:
        try:
            fn()
        except Exception:  # reported on every rank below
            import traceback

            error[0] = traceback.format_exc()
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise AssertionError(f"rank 0 failed:\n{error[0]}")


def write_references(out: Path) -> None:
    """transformers' own ``save_pretrained`` of every reference, in a process with no process group."""
    for arch in ARCHS:
        build(arch, seed=1).save_pretrained(out / arch)
    build("llama_untied", seed=1).save_pretrained(out / "sharded_index", max_shard_size="20KB")
    (out / "sharded_index" / "stale.safetensors").write_bytes(b"not read: the index does not name it")


def reference_dir(arch: str) -> tuple[torch.nn.Module, Path]:
    """The reference model and the directory transformers' own ``save_pretrained`` wrote it to.

    Under a process group transformers' ``save_pretrained`` writes on rank 0 only and ends with a
    barrier, so the references are written once, by a separate one-process run.
    """
    refs = work() / "refs"
    if rank() == 0 and not refs.exists():
        code = f"import hf_cases; hf_cases.write_references(__import__('pathlib').Path({str(refs)!r}))"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    dist.barrier()
    return build(arch, seed=1), refs / arch


def assert_weights(model: torch.nn.Module, want: dict[str, torch.Tensor], what: str) -> None:
    got = model.state_dict()
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:6]}"
    for k, v in want.items():
        g = full(got[k]).detach()
        assert g.dtype == v.dtype and torch.equal(g, v), (
            f"{what}: {k} differs (max {((g.double() - v.double()).abs().max())})"
        )


def check_load(arch: str, strat: str, meta: bool = False, materialize: bool = True) -> None:
    ref, d = reference_dir(arch)
    model = fsdp(build(arch, seed=2, meta=meta), auto_wrap=True, materialize=materialize, **STRATS[strat])
    load_pretrained(model, d)
    assert_weights(model, ref.state_dict(), f"{arch}/{strat}")
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not left, f"still on meta: {left}"
    # Same fp32 weights, same kernels, same inputs: the outputs are bit-identical.
    got, want = outputs(model, arch), outputs(ref, arch)
    assert torch.equal(got, want), f"{arch}/{strat}: outputs differ by {(got - want).abs().max():.3e}"


def check_save(arch: str, strat: str, dtype=None) -> None:
    ref, _ = reference_dir(arch)
    model = fsdp(copy.deepcopy(ref), auto_wrap=True, **STRATS[strat])
    out = work() / f"saved_{arch}_{strat}_{dtype}".replace("torch.", "")
    save_pretrained(model, out, dtype=dtype, max_shard_size="16KB", overwrite=True)

    def check() -> None:
        auto = ARCHS[arch]()[1]
        back = auto.from_pretrained(out).eval()
        assert type(back).__name__ == type(ref).__name__, type(back).__name__
        want = {k: v.to(dtype) if dtype and v.is_floating_point() else v for k, v in ref.state_dict().items()}
        assert_weights(back, want, f"save {arch}/{strat}")
        # ties stored once, as transformers stores them
        from safetensors import safe_open

        stored = set()
        for f in out.glob("*.safetensors"):
            with safe_open(str(f), "pt") as sf:
                stored |= set(sf.keys())
        same_tensors_as_transformers(arch, out, dtype)
        ties = getattr(ref, "all_tied_weights_keys", None) or {}
        dropped = {a for a, k in ties.items() if ref.get_parameter(a) is ref.get_parameter(k)}
        assert not (stored & dropped), f"tied aliases stored: {stored & dropped}"
        assert (out / "config.json").is_file()

    on_rank0(check)


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def same_tensors_as_transformers(arch: str, out: Path, dtype=None) -> None:
    """Every stored tensor equals, bit for bit and under the same key, what transformers' own
    ``save_pretrained`` stored for the reference (``reference_dir``; cast to ``dtype`` as a model
    ``.to(dtype)`` would be), both read back with ``safetensors.load_file``."""
    ours, theirs = _stored(out), _stored(work() / "refs" / arch)
    assert set(ours) == set(theirs), f"keys differ: {sorted(set(ours) ^ set(theirs))[:6]}"
    for k, v in theirs.items():
        v = v.to(dtype) if dtype is not None and v.is_floating_point() else v
        assert ours[k].dtype == v.dtype and ours[k].shape == v.shape and torch.equal(ours[k], v), k


def _clip_load_and_save() -> None:
    """CLIP: its 0-dim ``logit_scale`` stays whole in ``fsdp()``; it loads and saves like the rest."""
    check_load("clip", "FULL_SHARD")
    check_save("clip", "FULL_SHARD")


def _make_cases() -> None:
    for arch in ZOO:
        for strat in ("FULL_SHARD", "SHARD_GRAD", "NO_SHARD"):
            CASES[f"load_{arch}_{strat}"] = lambda a=arch, s=strat: check_load(a, s)
        CASES[f"save_{arch}"] = lambda a=arch: check_save(a, "FULL_SHARD")
        CASES[f"load_{arch}_HYBRID_SHARD"] = lambda a=arch: check_load(a, "HYBRID_SHARD")
        CASES[f"save_{arch}_HYBRID_SHARD"] = lambda a=arch: check_save(a, "HYBRID_SHARD")
    for arch in ("llama_tied", "bert_mlm", "mixtral", "gpt2"):
        CASES[f"load_meta_unmaterialized_{arch}"] = lambda a=arch: check_load(a, "FULL_SHARD", True, False)
    CASES["clip_load_and_save"] = _clip_load_and_save


_make_cases()


@case
def load_meta_materialized_llama_tied() -> None:
    check_load("llama_tied", "FULL_SHARD", meta=True, materialize=True)


@case
def meta_unmaterialized_ties_share_storage() -> None:
    _, d = reference_dir("llama_tied")
    model = fsdp(build("llama_tied", meta=True), auto_wrap=True, shard_strat="FULL_SHARD", materialize=False)
    # Nothing to save yet: refused by name on every rank, before anything is written.
    out = work() / "meta_save"
    expect_error(ValueError, lambda: save_pretrained(model, out), "meta device", "model.embed_tokens.weight")
    dist.barrier()
    assert not out.exists() and not (out.parent / ".meta_save.incomplete").exists()
    load_pretrained(model, d)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    inv = model.model.rotary_emb.inv_freq
    want = build("llama_tied").model.rotary_emb.inv_freq
    assert torch.equal(inv, want), "rotary inv_freq not recomputed"


class SharedMaskNet(torch.nn.Module):
    """Two blocks sharing ONE persistent buffer (a causal mask) and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        mask = torch.tril(torch.ones(4, 4)) * 3.0
        for block in self.blocks:
            block.register_buffer("mask", mask)  # the same tensor in every block
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight


@case
def shared_buffer_on_meta_and_untied_checkpoint_into_tied_model() -> None:
    """Issue 29 §5: a persistent buffer shared by several blocks, loaded into a meta model, fills every alias;
    an untied checkpoint (emb, head differ) into the tied model with strict=True is refused naming both keys."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = SharedMaskNet()
    with torch.no_grad():
        source.blocks[0].mask.copy_(torch.arange(16.0).view(4, 4))
    out = work() / "shared_mask"
    save_pretrained(fsdp(copy.deepcopy(source), shard_strat="FULL_SHARD"), out, overwrite=True)
    with torch.device("meta"):
        meta = SharedMaskNet()
    model = fsdp(meta, shard_strat="FULL_SHARD", materialize=False)
    load_pretrained(model, out)
    for i in range(2):
        assert torch.equal(model.blocks[i].mask, source.blocks[0].mask), f"blocks.{i}.mask not filled"
    assert model.blocks[1].mask is model.blocks[0].mask  # one tensor again, as the model was built
    assert torch.equal(full(model.head.weight), source.emb.weight)
    untied = work() / "untied"
    if rank() == 0:
        untied.mkdir(exist_ok=True)
        weights = {k: v.clone() for k, v in source.state_dict().items() if k != "blocks.1.mask"}
        weights["head.weight"] = weights["emb.weight"] + 1.0  # untied: another head
        save_file(weights, str(untied / "model.safetensors"))
    dist.barrier()
    before = full(model.emb.weight).clone()
    expect_error(CheckpointError, lambda: load_pretrained(model, untied), "'head.weight'", "'emb.weight'", "differ")
    assert torch.equal(full(model.emb.weight), before), "changed before raising"
    load_pretrained(model, untied, strict=False)  # the kept name's values, as asked
    assert torch.equal(full(model.emb.weight), source.emb.weight)


@case
def no_shard_save_before_first_forward_is_rank0s_model() -> None:
    """Issue 29 §5: NO_SHARD (the default) with ranks initialised differently: save_pretrained before the first
    forward writes rank 0's model (the one DDP's first forward would make every rank's), not a mix of ranks' rows."""
    from safetensors.torch import load_file

    torch.manual_seed(rank())  # a different initialisation on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.Linear(64, 6))
    init = [None]
    if rank() == 0:
        init[0] = {k: v.clone() for k, v in model.state_dict().items()}
    dist.broadcast_object_list(init, src=0)
    fsdp(model)  # the default: NO_SHARD
    out = work() / "no_shard_early"
    save_pretrained(model, out, overwrite=True)
    saved = load_file(str(out / "model.safetensors"))
    for key, want in init[0].items():
        assert torch.equal(saved[key], want), f"{key}: not rank 0's initial values"
        assert torch.equal(full(model.state_dict()[key]), want), f"{key}: rank {rank()} holds another model"


@case
def save_bf16_cast_on_write() -> None:
    check_save("llama_tied", "FULL_SHARD", dtype=torch.bfloat16)

    def check() -> None:
        from safetensors import safe_open

        out = work() / "saved_llama_tied_FULL_SHARD_bfloat16"
        for f in out.glob("*.safetensors"):
            with safe_open(str(f), "pt") as sf:
                for k in sf.keys():
                    assert sf.get_slice(k).get_dtype() == "BF16", (f, k)
        assert T.AutoConfig.from_pretrained(out).dtype == torch.bfloat16

    on_rank0(check)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: full(v).detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model, before) -> None:
    for k, v in _snapshot(model).items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused load"


def _edited_checkpoint(name: str, edit) -> Path:
    """A copy of the llama_untied reference with its tensors edited by ``edit(dict)``."""
    from safetensors.torch import load_file, save_file

    _, d = reference_dir("llama_untied")
    out = work() / name
    dist.barrier()
    if rank() == 0 and not out.exists():
        tensors = load_file(str(d / "model.safetensors"))
        edit(tensors)
        out.mkdir()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()
    return out


@case
def strict_errors_on_every_rank_before_change() -> None:
    model = fsdp(build("llama_untied", seed=3), auto_wrap=True, shard_strat="FULL_SHARD")
    before = _snapshot(model)
    missing = _edited_checkpoint("missing", lambda t: t.pop("lm_head.weight"))
    expect_error(CheckpointError, lambda: load_pretrained(model, missing), "missing keys", "lm_head.weight")
    _unchanged(model, before)
    extra = _edited_checkpoint("extra", lambda t: t.update({"model.bogus.weight": torch.zeros(2)}))
    expect_error(CheckpointError, lambda: load_pretrained(model, extra), "unexpected keys", "model.bogus.weight")
    _unchanged(model, before)
    load_pretrained(model, extra, strict=False)  # unexpected keys are fine when not strict
    wrong = _edited_checkpoint("wrong_shape", lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    expect_error(CheckpointError, lambda: load_pretrained(model, wrong, strict=False), "shape", "model.norm.weight")
    expect_error(FileNotFoundError, lambda: load_pretrained(model, work() / "nowhere"), "nowhere")


@case
def error_on_one_rank_raises_on_all() -> None:
    _, d = reference_dir("llama_untied")
    model = fsdp(build("llama_untied", seed=3), auto_wrap=True, shard_strat="FULL_SHARD")
    before = _snapshot(model)
    path = d if rank() == 0 else work() / "only_rank1_misses_this"
    msg = expect_error(FileNotFoundError, lambda: load_pretrained(model, path), "only_rank1_misses_this")
    assert rank() != 0 or "rank 1" in msg, msg
    _unchanged(model, before)


@case
def load_single_file_and_index() -> None:
    ref, d = reference_dir("llama_untied")
    model = fsdp(build("llama_untied", seed=3), auto_wrap=True, shard_strat="FULL_SHARD")
    load_pretrained(model, d / "model.safetensors")
    assert_weights(model, ref.state_dict(), "single file")
    sharded = d.parent / "sharded_index"
    assert (sharded / "model.safetensors.index.json").is_file()
    model = fsdp(build("llama_untied", seed=4), auto_wrap=True, shard_strat="SHARD_GRAD")
    load_pretrained(model, sharded)
    assert_weights(model, ref.state_dict(), "index")


@case
def existing_dir_refused_and_failed_save_keeps_it() -> None:
    ref, _ = reference_dir("llama_untied")
    model = fsdp(copy.deepcopy(ref), auto_wrap=True, shard_strat="FULL_SHARD")
    out = work() / "users_dir"
    if rank() == 0:
        out.mkdir(exist_ok=True)
        (out / "keep.txt").write_text("mine")
    dist.barrier()
    expect_error(FileExistsError, lambda: save_pretrained(model, out), "overwrite=True")
    expect_error(ValueError, lambda: save_pretrained(model, out, overwrite=True, dtype=torch.int8), "dtype")
    expect_error(ValueError, lambda: save_pretrained(model, out, overwrite=True, max_shard_size="lots"), "lots")
    # overwrite=True replaces only a directory this library could have written (issue 18): a folder of
    # the user's files (notes, docs/, .git/) is refused, byte for byte untouched, on every rank.
    if rank() == 0:
        (out / "docs").mkdir(exist_ok=True)
        (out / "docs" / "a.md").write_text("doc")
        (out / ".git").mkdir(exist_ok=True)
        (out / ".git" / "HEAD").write_text("ref: main")
    dist.barrier()
    before = {str(p): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    expect_error(FileExistsError, lambda: save_pretrained(model, out, overwrite=True), str(out), "keep.txt", "refusing")
    assert {str(p): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    assert not (out.parent / ".users_dir.incomplete").exists()
    # A directory of ours is replaced; a save that fails midway (one rank's disk) leaves it as it was.
    ours = work() / "ours_dir"
    save_pretrained(model, ours, overwrite=True, max_shard_size="8KB")
    kept = {p.name: p.read_bytes() for p in sorted(ours.iterdir())}
    import zeta_fsdp.hf.save as save_mod  # where save_pretrained's byte writer is looked up

    real = save_mod.write_at

    def failing(fd, offset, tensor, **kw):
        if rank() == world() - 1:
            raise OSError("disk full (injected)")
        real(fd, offset, tensor, **kw)

    save_mod.write_at = failing
    try:
        expect_error(Exception, lambda: save_pretrained(model, ours, overwrite=True, max_shard_size="8KB"), "injected")
    finally:
        save_mod.write_at = real
    dist.barrier()
    assert {p.name: p.read_bytes() for p in sorted(ours.iterdir())} == kept, "a failed save changed the directory"
    assert not (ours.parent / ".ours_dir.incomplete").exists()
    dist.barrier()  # every rank looked before rank 0 stages the next save
    save_pretrained(model, ours, overwrite=True)  # our own output: replaced
    names = sorted(p.name for p in ours.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"], names  # the 8KB shards: gone


@case
def consolidate_checkpoint_to_hf() -> None:
    ref, d = reference_dir("mixtral")
    model = fsdp(copy.deepcopy(ref), auto_wrap=True, shard_strat="FULL_SHARD")
    ckpt = work() / "ckpt_mixtral"
    save_checkpoint(ckpt, model, overwrite=True)

    def check() -> None:
        out = consolidate_to_hf(ckpt, work() / "cons_mixtral", config=d, max_shard_size="16KB", overwrite=True)
        back = T.AutoModelForCausalLM.from_pretrained(out)
        assert_weights(back, ref.state_dict(), "consolidate_to_hf")
        cli = work() / "cons_cli"
        cmd = [sys.executable, "-m", "zeta_fsdp", "consolidate", str(ckpt), str(cli), "--hf", "--config", str(d)]
        proc = subprocess.run(cmd + ["--dtype", "bf16"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        back = T.AutoModelForCausalLM.from_pretrained(cli)
        assert back.dtype == torch.bfloat16
        assert_weights(back, {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}, "cli")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode != 0 and "overwrite" in proc.stderr + proc.stdout, proc.stderr

    on_rank0(check)


@case
def index_outside_or_malformed_refused_on_every_rank() -> None:
    """Issue 18: reads stay inside the model directory; a malformed index is a CheckpointError on every
    rank before any parameter changes; the Hugging Face cache layout (links into ../../blobs) loads."""
    ref, d = reference_dir("llama_untied")
    model = fsdp(build("llama_untied", seed=3), auto_wrap=True, shard_strat="FULL_SHARD")
    before = _snapshot(model)
    root = work() / "index_cases"
    secret = root / "outside" / "secret.safetensors"
    keys = list(json.loads((d.parent / "sharded_index" / INDEX_NAME).read_text())["weight_map"])

    def make() -> None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)  # a relaunch of the case starts afresh
        secret.parent.mkdir(parents=True)
        shutil.copy(d / "model.safetensors", secret)
        for name, value in {
            "relative": {"weight_map": {k: "../outside/secret.safetensors" for k in keys}},
            "absolute": {"weight_map": {k: str(secret) for k in keys}},
            "a_list": [1, 2],
            "not_a_string": {"weight_map": {k: 7 for k in keys}},
        }.items():
            (root / name).mkdir()
            (root / name / INDEX_NAME).write_text(json.dumps(value))
        # the hub cache: models--x/snapshots/<rev>/model.safetensors -> ../../blobs/<hash>
        blobs, snap = root / "models--x" / "blobs", root / "models--x" / "snapshots" / "abc"
        blobs.mkdir(parents=True)
        snap.mkdir(parents=True)
        shutil.copy(d / "model.safetensors", blobs / "0123")
        os.symlink("../../blobs/0123", snap / "model.safetensors")

    on_rank0(make)
    for name, needles in {
        "relative": ["../outside/secret.safetensors", "not a file inside"],
        "absolute": [str(secret), "not a file inside"],
        "a_list": ["weight_map"],
        "not_a_string": ["not a file name"],
    }.items():
        expect_error(CheckpointError, lambda n=name: load_pretrained(model, root / n), *needles)
        _unchanged(model, before)
    load_pretrained(model, root / "models--x" / "snapshots" / "abc")
    assert_weights(model, ref.state_dict(), "hub cache layout")


@case
def save_uneven_shards_every_engine() -> None:
    """Dims that do not split evenly over the ranks (FSDP2 pads the last shard), the
    replicated engine (NO_SHARD: plain tensors, rows split between ranks), a cast on write and
    one file per tensor: the files hold transformers' tensors, bit for bit."""
    ref, _ = reference_dir("llama_uneven")
    for strat, dtype, size in (
        ("FULL_SHARD", None, "5GB"),
        ("NO_SHARD", None, "4KB"),
        ("FULL_SHARD", torch.bfloat16, "4KB"),
    ):
        model = fsdp(copy.deepcopy(ref), auto_wrap=True, **STRATS[strat])
        if strat == "FULL_SHARD" and world() == 2:
            local = model.lm_head.weight.to_local().shape[0]
            assert local == (49 if rank() == 0 else 48), local  # ceil(97 / 2) rows, then the rest
        out = work() / f"uneven_{strat}_{dtype}_{size}".replace("torch.", "")
        save_pretrained(model, out, dtype=dtype, max_shard_size=size, overwrite=True)
        on_rank0(lambda o=out, d=dtype: same_tensors_as_transformers("llama_uneven", o, d))
    # Buffers may differ between replicas (BatchNorm statistics are each rank's own): the file
    # holds one rank's copy (rank 0's), never rows mixed from several ranks.
    torch.manual_seed(6)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    weight = net[0].weight.detach().clone()
    fsdp(net, shard_strat="NO_SHARD")
    net[1].running_mean.fill_(1.0 + rank())
    out = work() / "buffers_no_shard"
    save_pretrained(net, out, overwrite=True)

    def check() -> None:
        stored = _stored(out)
        assert torch.equal(stored["1.running_mean"], torch.full((6,), 1.0)), stored["1.running_mean"]
        assert torch.equal(stored["0.weight"], weight)

    on_rank0(check)


@case
def sharded_shapes_are_real_shards() -> None:
    """Guards the premise of the memory claim: under FULL_SHARD each rank holds 1/world of a weight."""
    model = fsdp(build("llama_untied"), auto_wrap=True, shard_strat="FULL_SHARD")
    w = model.lm_head.weight
    assert isinstance(w, DTensor) and w.to_local().shape[0] == w.shape[0] // world()


def _traced(name, fn):
    def run():
        import faulthandler

        print(f"[rank {rank()}] {name}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(60, exit=False)
        try:
            return fn()
        finally:
            faulthandler.cancel_dump_traceback_later()

    return run


@case
def foreign_file_during_save_kept_and_stale_index_ignored() -> None:
    """Issue 29, 3.: tokenizer.json written into the model directory by another process while save_pretrained
    (overwrite=True, 2 ranks) writes its first bytes is kept under out.kept, byte for byte, named in the warning;
    the new model is in place. 6.: a directory with model.safetensors and a stale index (transformers' re-save
    leaves one) loads the single file, as transformers' from_pretrained does."""
    import zeta_fsdp.hf.save as save_mod

    ref, _ = reference_dir("llama_untied")
    model = fsdp(copy.deepcopy(ref), auto_wrap=True, shard_strat="FULL_SHARD")
    out = work() / "raced"
    save_pretrained(model, out, overwrite=True, max_shard_size="8KB")
    token = b'{"model": {"type": "BPE"}}\n\x00\xff'
    real, wrote = save_mod.write_at, []

    def racing(fd, offset, tensor, **kw):
        if rank() == 1 and not wrote:  # another process, at the library's first data write on rank 1
            (out / "tokenizer.json").write_bytes(token)
            wrote.append(1)
        real(fd, offset, tensor, **kw)

    save_mod.write_at = racing
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            save_pretrained(model, out, overwrite=True)
    finally:
        save_mod.write_at = real
    dist.barrier()
    kept = out.parent / "raced.kept"
    assert sorted(p.name for p in kept.iterdir()) == ["tokenizer.json"], sorted(kept.iterdir())
    assert (kept / "tokenizer.json").read_bytes() == token
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    if rank() == 0:
        assert any(str(kept) in str(w.message) and "tokenizer.json" in str(w.message) for w in caught), caught
    back = build("llama_untied", seed=9)
    load_pretrained(back, out)
    assert_weights(back, ref.state_dict(), "saved after the race")
    # a stale index beside model.safetensors: the single file wins (transformers' precedence)
    stale = work() / "stale_index"
    if rank() == 0:
        stale.mkdir(exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            (stale / name).write_bytes((out / name).read_bytes())
        (stale / INDEX_NAME).write_text(
            json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00009.safetensors"}})
        )
    dist.barrier()
    model = fsdp(build("llama_untied", seed=4), auto_wrap=True, shard_strat="FULL_SHARD")
    load_pretrained(model, stale)
    assert_weights(model, ref.state_dict(), "single file beside a stale index")
    theirs = T.AutoModelForCausalLM.from_pretrained(stale)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in theirs.state_dict().items()), "transformers differs"


if __name__ == "__main__":
    if os.environ.get("ZETA_HF_TRACE"):  # which case a hung launch was in
        for _name in list(CASES):
            CASES[_name] = _traced(_name, CASES[_name])
    run_cases(CASES)

"""``python -m zeta_fsdp doctor``: a preflight of a launch, run under the job's own launcher.

``torchrun ... -m zeta_fsdp doctor`` (or ``srun``) instead of the training script: in seconds it
says whether the launch would work, one line per problem, exit code 1 if any. Each rank collects
what it sees (``local_facts``: host, LOCAL_RANK and devices, backend, the network interface the
backend will use) and publishes it in the rendezvous store; rank 0 waits for them with a short
timeout (so a rank that never comes is named, instead of a collective hanging for 30 minutes),
runs the pure checks of ``doctor_checks``, and only then starts a process group for one small
all-reduce, one all-gather and one transfer per ring link, with measured bandwidth.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import struct
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..distributed import shutdown
from ..torch_compat import all_gather_single
from .args import int_in
from .doctor_checks import (
    LinkResult,
    RankFacts,
    all_problems,
    check_links,
    describe_job,
    is_loopback,
    node_count,
    slowest_at_collective,
)
from .doctor_model import first_step
from .model_spec import MODEL_SPEC_HELP

__all__ = ["HELP", "add_arguments", "gloo_interface", "local_facts", "route_interface", "run"]

HELP = "check a launch in seconds (world size, hosts, devices, network, a small collective per link); run it under torchrun/srun"
_PREFIX = "zeta_fsdp/doctor"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    seconds = int_in(1, 3600, "--timeout")
    parser.add_argument("--timeout", type=seconds, default=30, help="seconds to wait for every rank (default 30)")
    parser.add_argument(
        "--nnodes",
        type=int_in(1, None, "--nnodes"),
        help="nodes the job should have (default: SLURM_NNODES, else the launcher's)",
    )
    per_node = int_in(1, None, "--nproc-per-node")
    parser.add_argument(
        "--nproc-per-node", type=per_node, help="processes per node expected (default: LOCAL_WORLD_SIZE)"
    )
    parser.add_argument(
        "--mib", type=int_in(1, 4096, "--mib"), default=4, help="MiB moved per collective and link (default 4)"
    )
    parser.add_argument("--slow", type=float, default=5.0, help="seconds late that make a rank slow (default 5)")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="device the job will use (default: CUDA when available)",
    )
    parser.add_argument(
        "--model",
        help="also run this model's first training step, sharded by fsdp(auto_wrap=True) with the divergence "
        "check on every forward: " + MODEL_SPEC_HELP,
    )
    parser.add_argument("--shard-strat", default="FULL_SHARD", help="shard_strat for --model (default FULL_SHARD)")


def _env_int(*names: str) -> Optional[int]:
    for name in names:
        if os.environ.get(name, "").strip().isdigit():
            return int(os.environ[name])
    return None


def _interface_addresses() -> dict[str, str]:
    """{interface: IPv4 address} of this host (Linux ioctl; interfaces without one are left out)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def _with_deadline(fn: Callable[[], Any], seconds: float) -> Any:
    """``fn()`` or ``None`` if it raised or took longer (name resolution can wait on an unreachable DNS)."""
    box: list = [None]

    def target() -> None:
        try:
            box[0] = fn()
        except (OSError, UnicodeError):
            pass

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return box[0]


def resolve(name: str) -> list[str]:
    """The IPv4/IPv6 addresses ``name`` resolves to (empty if it does not within 3 s)."""
    infos = _with_deadline(lambda: socket.getaddrinfo(name, None), 3.0) or []
    return sorted({info[4][0] for info in infos})


def route_interface(address: str) -> tuple[str, str]:
    """(interface, local address) of the route this host takes to ``address`` (no packet is sent)."""
    resolved = resolve(address) or [address]
    try:
        family = socket.AF_INET6 if ":" in resolved[0] else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((resolved[0], 9))  # UDP connect only picks the route
            local = s.getsockname()[0]
    except OSError:
        return "", ""
    name = next((n for n, a in _interface_addresses().items() if a == local), "")
    return name or ("lo" if is_loopback(local) else ""), local


def gloo_interface(master_addr: str) -> tuple[str, str, bool, bool]:
    """What gloo will bind: GLOO_SOCKET_IFNAME when set, else the address the hostname resolves to
    (gloo's own rule, and the classic multi-node trap: /etc/hosts maps it to 127.0.1.1).
    Returns (interface, why, is loopback, named but missing)."""
    names = _interface_addresses()
    chosen = os.environ.get("GLOO_SOCKET_IFNAME", "").strip()
    if chosen:
        first = chosen.split(",")[0]
        return chosen, "GLOO_SOCKET_IFNAME", is_loopback(names.get(first, "")), first not in names
    host = socket.gethostname()
    addresses = resolve(host)
    if not addresses or all(is_loopback(a) for a in addresses):
        why = f"hostname {host!r} resolves to {', '.join(addresses) or 'nothing'}; gloo falls back to loopback"
        return "lo", why, True, False
    name = next((n for n, a in names.items() if a in addresses), "?")
    return name, f"hostname {host!r} resolves to {addresses[0]}", False, False


def nccl_interface(master_addr: str) -> tuple[str, str, bool, bool]:
    """What NCCL's bootstrap will use: NCCL_SOCKET_IFNAME (a prefix list) when set, else its own pick,
    reported as the interface of the route to MASTER_ADDR."""
    chosen = os.environ.get("NCCL_SOCKET_IFNAME", "").strip()
    if chosen:
        prefixes = [p.lstrip("=") for p in chosen.split(",") if not p.startswith("^")]
        names = [n for _, n in socket.if_nameindex()]
        missing = bool(prefixes) and not any(n.startswith(p) for p in prefixes for n in names)
        return chosen, "NCCL_SOCKET_IFNAME", all(p.startswith("lo") for p in prefixes) and bool(prefixes), missing
    name, _ = route_interface(master_addr) if master_addr else ("", "")
    return name, "NCCL's pick; the route to MASTER_ADDR", name == "lo", False


def local_facts(device_choice: str = "auto") -> RankFacts:
    """What this rank sees: launcher variables, host, the device and backend it will use, the interface."""
    rank, world = _env_int("RANK") or 0, _env_int("WORLD_SIZE") or 1
    local_rank = _env_int("LOCAL_RANK") or 0
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and cuda_count > 0)
    backend = "nccl" if use_cuda else "gloo"
    master = os.environ.get("MASTER_ADDR", "")
    if world > 1:
        iface, why, loopback, missing = (nccl_interface if use_cuda else gloo_interface)(master)
    else:
        iface, why, loopback, missing = "", "one process: no network", False, False
    return RankFacts(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=_env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE") or 1,
        host=socket.gethostname(),
        node_rank=_env_int("GROUP_RANK", "SLURM_NODEID"),
        nnodes=_env_int("GROUP_WORLD_SIZE", "SLURM_NNODES"),
        master_addr=master,
        device=f"cuda:{local_rank}" if use_cuda else "cpu",
        cuda_count=cuda_count,
        cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        backend=backend,
        interface=iface,
        interface_source=why,
        interface_loopback=loopback,
        interface_missing=missing,
        arrived=time.time(),
    )


def _connect_store(facts: RankFacts, timeout_s: float) -> dist.Store:
    """The rendezvous store: torchrun's agent store, or (a plain ``srun`` launch) one rank 0 hosts."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host,
        port,
        is_master=facts.rank == 0 and not agent,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"{_PREFIX}/{attempt}", store)


def _gather_facts(store: dist.Store, world: int, timeout_s: float) -> list[RankFacts]:
    """Rank 0: every rank's facts that arrive before the deadline (polling, never a blocking wait)."""
    keys, got = [f"facts/{r}" for r in range(world)], {}
    deadline = time.monotonic() + timeout_s
    while len(got) < world and time.monotonic() < deadline:
        for r, key in enumerate(keys):
            if r not in got and store.check([key]):
                got[r] = RankFacts.from_dict(json.loads(store.get(key)))
        time.sleep(0.05)
    return [got[r] for r in sorted(got)]


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _collectives(facts: list[RankFacts], me: RankFacts, nbytes: int, slow_s: float) -> tuple[list[str], list[str]]:
    """In the started group: who reaches the first collective last, an all-reduce, an all-gather,
    then one send per ring link (rank r -> r+1), all at once. Returns (info lines, problems)."""
    world, device = len(facts), torch.device(me.device)
    waits = torch.zeros(world, dtype=torch.float64, device=device)
    wait = _timed(lambda: dist.all_reduce(torch.zeros(1, device=device)), device)
    all_gather_single(waits, torch.tensor([wait], dtype=torch.float64, device=device))
    late, lag = slowest_at_collective(waits.tolist())
    info = [f"first collective: rank {late} ({facts[late].host}) arrived last, {lag * 1000:.1f} ms after the median"]
    n = max(world, nbytes // 4 // world * world)
    buf = torch.ones(n, device=device)
    t_ar = min(_timed(lambda: dist.all_reduce(buf), device) for _ in range(3))
    out = torch.empty(n, device=device)
    t_ag = min(_timed(lambda: all_gather_single(out, buf[: n // world]), device) for _ in range(3))
    size = n * 4
    info.append(
        f"all_reduce {size / 2**20:.1f} MiB: {t_ar * 1000:.1f} ms, bus {2 * (world - 1) / world * size / t_ar / 1e9:.3g} GB/s"
    )
    info.append(
        f"all_gather {size / 2**20:.1f} MiB: {t_ag * 1000:.1f} ms, bus {(world - 1) / world * size / t_ag / 1e9:.3g} GB/s"
    )
    links = _ring_links(facts, me, buf, device)
    info += [f"link rank {x.src} ({x.hosts[0]}) -> rank {x.dst} ({x.hosts[1]}): {x.gbps:.3g} GB/s" for x in links]
    problems = (
        [f"rank {late} ({facts[late].host}) reached the first collective {lag:.1f} s after the others"]
        if lag > slow_s
        else []
    )
    return info, problems + check_links(links)


def _ring_links(facts: list[RankFacts], me: RankFacts, buf: torch.Tensor, device: torch.device) -> list[LinkResult]:
    """Every rank sends ``buf`` to the next and receives from the previous one at once; each link's time
    is the receiver's, gathered to every rank."""
    world, rank = len(facts), me.rank
    recv = torch.empty_like(buf)

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, buf, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    dist.all_reduce(torch.zeros(1, device=device))  # start together
    seconds = torch.zeros(world, dtype=torch.float64, device=device)
    all_gather_single(seconds, torch.tensor([_timed(exchange, device)], dtype=torch.float64, device=device))
    nbytes = buf.numel() * buf.element_size()
    links = []
    for dst in range(world):
        src = (dst - 1) % world
        links.append(LinkResult(src, dst, nbytes, float(seconds[dst]), (facts[src].host, facts[dst].host)))
    return links


def _publish_verdict(store: dist.Store, key: str, lines: list[str], ok: bool) -> None:
    store.set(key, json.dumps({"ok": ok, "lines": lines}))


def _await_verdict(store: dist.Store, key: str, timeout_s: float) -> bool:
    """Ranks > 0: rank 0's verdict ``key`` (``False`` also when rank 0 is gone), then say we read it."""
    try:
        store.set_timeout(timedelta(seconds=timeout_s))
        ok = bool(json.loads(store.get(key))["ok"])
        store.add(f"read/{key}", 1)
    except (RuntimeError, dist.DistError) as e:
        print(f"doctor: PROBLEM: no verdict from rank 0 within {timeout_s:g} s ({str(e).splitlines()[0]})", flush=True)
        return False
    return ok


def _let_readers_finish(store: dist.Store, key: str, readers: int, timeout_s: float) -> None:
    """Rank 0 may host the store (a plain srun launch): it leaves only after the others read ``key``."""
    deadline = time.monotonic() + timeout_s
    while readers > 0 and store.add(f"read/{key}", 0) < readers and time.monotonic() < deadline:
        time.sleep(0.05)


def _rank0_preflight(
    store: dist.Store, me: RankFacts, args: argparse.Namespace
) -> tuple[list[RankFacts], list[str], list[str]]:
    """Rank 0: wait for every rank's facts, then run the pure checks. Returns (facts, info, problems)."""
    facts = _gather_facts(store, me.world_size, args.timeout)
    nnodes = args.nnodes or _env_int("SLURM_NNODES")
    master = me.master_addr
    problems = all_problems(
        facts,
        world_size=me.world_size,
        master_resolved=resolve(master) if master else [],
        timeout_s=args.timeout,
        slow_s=args.slow,
        nnodes=nnodes,
        nproc_per_node=args.nproc_per_node,
    )
    return facts, describe_job(facts, node_count(facts, nnodes)), problems


def _report(lines: list[str], problems: list[str]) -> int:
    for line in lines:
        print(f"doctor: {line}")
    for line in problems:
        print(f"doctor: PROBLEM: {line}")
    verdict = "all checks passed" if not problems else f"{len(problems)} problem(s)"
    print(f"doctor: {verdict}", flush=True)
    return 1 if problems else 0


def _run_distributed(me: RankFacts, args: argparse.Namespace) -> int:
    """Store rendezvous with a deadline, checks, then the collectives; every rank exits with rank 0's verdict."""
    try:
        store = _connect_store(me, args.timeout)
    except (RuntimeError, dist.DistError, OSError) as e:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        print(
            f"doctor: PROBLEM: {me.where}: cannot reach the rendezvous store at {where} within {args.timeout} s ({e})",
            flush=True,
        )
        return 1
    store.set(f"facts/{me.rank}", json.dumps(me.to_dict()))
    wait_s = args.timeout * 3 + 10  # rank 0 waits up to --timeout for the others, then checks
    if me.rank == 0:
        facts, info, problems = _rank0_preflight(store, me, args)
        _publish_verdict(store, "preflight", info, not problems)
        if problems:
            _let_readers_finish(store, "preflight", len(facts) - 1, args.timeout)
            return _report(info, problems)
    else:
        if not _await_verdict(store, "preflight", wait_s):
            return 1
        facts = [RankFacts.from_dict(json.loads(store.get(f"facts/{r}"))) for r in range(me.world_size)]
    more, link_problems = _start_and_measure(store, facts, me, args)
    if me.rank == 0:
        _publish_verdict(store, "final", [], not link_problems)
        _let_readers_finish(store, "final", len(facts) - 1, args.timeout)
        return _report(info + more, link_problems)
    return 0 if _await_verdict(store, "final", wait_s) else 1


def _start_and_measure(
    store: dist.Store, facts: list[RankFacts], me: RankFacts, args: argparse.Namespace
) -> tuple[list[str], list[str]]:
    """Start a process group on the same store (short timeout), run the collectives, leave cleanly."""
    device = torch.device(me.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        group_store = dist.PrefixStore("pg", store)
        timeout = timedelta(seconds=args.timeout)
        dist.init_process_group(me.backend, store=group_store, rank=me.rank, world_size=me.world_size, timeout=timeout)
        info, problems = _collectives(facts, me, args.mib * 2**20, args.slow)
        if args.model:
            more, model_problems = first_step(args.model, args.shard_strat, device)
            info, problems = info + more, problems + model_problems
    except (RuntimeError, dist.DistError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [], [f"{me.where}: the collectives failed within {args.timeout} s: {first}"]
    shutdown(force=True, timeout_s=args.timeout)
    return info, problems


def run(args: argparse.Namespace) -> int:
    """Check this launch; print the report on rank 0; return 1 if there is any problem."""
    me = local_facts(args.device)
    if me.world_size == 1 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        problems = all_problems(
            [me], world_size=me.world_size, master_resolved=[], timeout_s=args.timeout, slow_s=args.slow,
            nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
        )  # fmt: skip
        if me.world_size > 1:
            problems.insert(
                0, f"WORLD_SIZE={me.world_size} but MASTER_ADDR/MASTER_PORT are not set: run under torchrun or srun"
            )
        return _report(describe_job([me], 1), problems)
    code = _run_distributed(me, args)
    sys.stdout.flush()
    return code

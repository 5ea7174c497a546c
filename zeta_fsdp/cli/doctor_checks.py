"""The checks of ``python -m zeta_fsdp doctor``, as pure functions of what the ranks reported.

Nothing here touches the network, a device or a process group: ``doctor`` collects each rank's
``RankFacts`` and the measured timings, and these functions turn them into problem lines (one
line per problem, naming the rank, its host and what to change) and a short description of the
job. So every check is unit-tested with made-up facts (tests/test_doctor.py).
"""

from __future__ import annotations

import ipaddress
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

__all__ = ["LinkResult", "RankFacts", "check_arrivals", "check_device", "check_hosts", "check_interface"]
__all__ += ["check_links", "check_master_addr", "check_world", "describe_job", "is_loopback", "node_count"]
__all__ += ["all_problems", "slowest_at_collective"]


@dataclass
class RankFacts:
    """What one rank sees of its launch (collected by ``doctor.local_facts``, sent through the store)."""

    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    host: str = "localhost"
    node_rank: Optional[int] = None  # torchrun's GROUP_RANK, SLURM_NODEID
    nnodes: Optional[int] = None  # torchrun's GROUP_WORLD_SIZE, SLURM_NNODES
    master_addr: str = ""
    device: str = "cpu"  # the device this rank will compute on: "cpu" or "cuda:<LOCAL_RANK>"
    cuda_count: int = 0
    cuda_visible: Optional[str] = None  # CUDA_VISIBLE_DEVICES as set
    backend: str = "gloo"
    interface: str = ""  # the network interface the backend will use ("" when unknown)
    interface_source: str = ""  # why: "GLOO_SOCKET_IFNAME", "hostname 'x' resolves to 127.0.1.1", ...
    interface_loopback: bool = False
    interface_missing: bool = False  # the *_SOCKET_IFNAME names no interface of this host
    arrived: float = 0.0  # wall-clock time (time.time()) the rank published its facts

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankFacts:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    @property
    def where(self) -> str:
        return f"rank {self.rank} on {self.host}"


@dataclass
class LinkResult:
    """One measured link: ``src`` sent ``nbytes`` to ``dst`` in ``seconds`` (``None``: it failed)."""

    src: int
    dst: int
    nbytes: int
    seconds: Optional[float]
    hosts: tuple[str, str] = ("", "")
    note: str = field(default="")

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def inter_node(self) -> bool:
        return self.hosts[0] != self.hosts[1]


def is_loopback(address: str) -> bool:
    """``True`` for ``localhost``, ``127.x.y.z`` and ``::1`` (no name resolution: pass resolved addresses too).

    Example:
        >>> is_loopback("127.0.1.1"), is_loopback("10.0.0.2"), is_loopback("localhost")
        (True, False, True)
    """
    if address.strip().lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def node_count(facts: list[RankFacts], expected: Optional[int] = None) -> int:
    """Nodes in the job: ``expected`` when given, else what the launcher says (GROUP_WORLD_SIZE,
    SLURM_NNODES), else the distinct node ranks, else the distinct hosts."""
    if expected:
        return expected
    told = {f.nnodes for f in facts if f.nnodes}
    if told:
        return max(told)
    node_ranks = {f.node_rank for f in facts if f.node_rank is not None}
    return len(node_ranks) if node_ranks else len({f.host for f in facts})


def check_world(facts: list[RankFacts], world_size: int, nodes: int, nproc_per_node: Optional[int] = None) -> list[str]:
    """World size = nodes x processes per node; every rank agrees on WORLD_SIZE, LOCAL_WORLD_SIZE; no rank twice."""
    problems = []
    sizes = sorted({f.world_size for f in facts})
    if len(sizes) > 1:
        problems.append(f"ranks disagree on WORLD_SIZE: {sizes} (every node's launcher must say the same)")
    local_sizes = sorted({f.local_world_size for f in facts})
    if len(local_sizes) > 1:
        problems.append(
            f"nodes run different numbers of processes (LOCAL_WORLD_SIZE {local_sizes}): use one --nproc-per-node"
        )
    per_node = nproc_per_node or local_sizes[-1]
    if world_size != nodes * per_node:
        problems.append(
            f"world size {world_size} != {nodes} node(s) x {per_node} process(es) per node = {nodes * per_node}"
        )
    seen: dict[int, RankFacts] = {}
    for f in facts:
        if f.rank in seen:
            problems.append(
                f"RANK {f.rank} is used twice ({seen[f.rank].host} and {f.host}): two launchers on one node?"
            )
        seen[f.rank] = f
    return problems


def check_hosts(facts: list[RankFacts], nodes: int) -> list[str]:
    """More than one node: the ranks must run on ``nodes`` distinct hosts, no host holding two ranks' LOCAL_RANK."""
    problems = []
    hosts = sorted({f.host for f in facts})
    if nodes > 1 and len(hosts) < nodes:
        problems.append(
            f"the job has {nodes} nodes but its ranks run on {len(hosts)} host(s) ({', '.join(hosts)}): "
            "did each node rendezvous with itself? Give every node the same --rdzv-endpoint / MASTER_ADDR"
        )
    taken: dict[tuple[str, int], int] = {}
    for f in facts:
        key = (f.host, f.local_rank)
        if key in taken:
            problems.append(f"ranks {taken[key]} and {f.rank} on {f.host} both have LOCAL_RANK={f.local_rank}")
        taken.setdefault(key, f.rank)
    return problems


def check_master_addr(master_addr: str, resolved: list[str], nodes: int) -> list[str]:
    """With more than one node, the rendezvous address must not be a loopback (``resolved``: its addresses)."""
    if nodes <= 1 or not master_addr:
        return []
    if is_loopback(master_addr) or (resolved and all(is_loopback(a) for a in resolved)):
        shown = f"{master_addr} ({', '.join(resolved)})" if resolved and resolved != [master_addr] else master_addr
        return [
            f"MASTER_ADDR / the rendezvous endpoint is a loopback address, {shown}, in a {nodes}-node job: "
            "other nodes cannot reach it; use an address of the first node they can reach"
        ]
    return []


def check_device(f: RankFacts) -> list[str]:
    """The rank sees the device it will use (CUDA: LOCAL_RANK < device count) and the backend fits it."""
    problems = []
    if f.device.startswith("cuda") and f.local_rank >= f.cuda_count:
        visible = (
            f"CUDA_VISIBLE_DEVICES={f.cuda_visible!r}" if f.cuda_visible is not None else "CUDA_VISIBLE_DEVICES unset"
        )
        problems.append(
            f"{f.where}: LOCAL_RANK={f.local_rank} but it sees {f.cuda_count} CUDA device(s) ({visible}): "
            "start at most one process per visible GPU"
        )
    if "nccl" in f.backend and not f.device.startswith("cuda"):
        problems.append(f"{f.where}: backend {f.backend!r} needs a CUDA device, this rank computes on {f.device}")
    return problems


def check_interface(f: RankFacts, nodes: int) -> list[str]:
    """The interface gloo/NCCL will use exists, and is not a loopback when other nodes must reach it."""
    name = "NCCL_SOCKET_IFNAME" if "nccl" in f.backend else "GLOO_SOCKET_IFNAME"
    if f.interface_missing:
        return [f"{f.where}: {f.interface_source} names no network interface of this host ({f.interface})"]
    if nodes > 1 and f.interface_loopback:
        return [
            f"{f.where}: {f.backend} will use the loopback interface ({f.interface_source}), which other nodes "
            f"cannot reach: set {name} to the interface of the route to MASTER_ADDR"
        ]
    return []


def check_arrivals(facts: list[RankFacts], world_size: int, timeout_s: float, slow_s: float) -> list[str]:
    """Every rank published its facts within ``timeout_s``; none ``slow_s`` later than the first.

    Example:
        >>> check_arrivals([RankFacts(0, 2)], 2, 5.0, 2.0)
        ['rank(s) [1] of 2 did not arrive within 5 s (arrived: [0]): not started, or stuck before the check']
    """
    arrived = sorted(f.rank for f in facts)
    missing = [r for r in range(world_size) if r not in arrived]
    problems = []
    if missing:
        problems.append(
            f"rank(s) {missing} of {world_size} did not arrive within {timeout_s:g} s (arrived: {arrived}): "
            "not started, or stuck before the check"
        )
    if len(facts) > 1:
        first = min(f.arrived for f in facts)
        late = max(facts, key=lambda f: f.arrived)
        if late.arrived - first > slow_s:
            problems.append(f"{late.where} arrived {late.arrived - first:.1f} s after the first rank (slow start)")
    return problems


def slowest_at_collective(waits: list[float]) -> tuple[int, float]:
    """The rank that reached a collective last, and how late: each rank's wait inside it (``waits``).

    The last rank to arrive waits least; the others wait for it. Its lateness is the median
    wait minus its own.

    Example:
        >>> slowest_at_collective([0.50, 0.01, 0.49])
        (1, 0.48)
    """
    rank = min(range(len(waits)), key=waits.__getitem__)
    return rank, round(statistics.median(waits) - waits[rank], 6)


def check_links(links: list[LinkResult], slow_factor: float = 4.0) -> list[str]:
    """A link that failed, or is ``slow_factor`` times slower than the median link of its kind
    (within a node / between nodes: they differ by design)."""
    problems = [
        f"link rank {x.src} ({x.hosts[0]}) -> rank {x.dst} ({x.hosts[1]}) failed: {x.note}"
        for x in links
        if x.seconds is None
    ]
    for inter in (False, True):
        kind = [x for x in links if x.seconds and x.inter_node == inter]
        if len(kind) < 2:
            continue
        median = statistics.median(x.gbps for x in kind)
        for x in kind:
            if x.gbps * slow_factor < median:
                problems.append(
                    f"slow link rank {x.src} ({x.hosts[0]}) -> rank {x.dst} ({x.hosts[1]}): {x.gbps:.3g} GB/s, "
                    f"median of {'inter' if inter else 'intra'}-node links {median:.3g} GB/s"
                )
    return problems


def all_problems(
    facts: list[RankFacts],
    *,
    world_size: int,
    master_resolved: list[str],
    timeout_s: float,
    slow_s: float,
    nnodes: Optional[int] = None,
    nproc_per_node: Optional[int] = None,
) -> list[str]:
    """Every check that needs only the ranks' facts (run before any collective), in order."""
    nodes = node_count(facts, nnodes)
    problems = check_arrivals(facts, world_size, timeout_s, slow_s)
    if len(facts) == world_size:  # with ranks missing, the layout the others imply is only a guess
        problems += check_world(facts, world_size, nodes, nproc_per_node)
    problems += check_hosts(facts, nodes)
    master = facts[0].master_addr if facts else ""
    problems += check_master_addr(master, master_resolved, nodes)
    for f in sorted(facts, key=lambda f: f.rank):
        problems += check_device(f) + check_interface(f, nodes)
    return problems


def describe_job(facts: list[RankFacts], nodes: int) -> list[str]:
    """Informational lines: the layout, hosts, devices, backend and interfaces the ranks reported."""
    by_host: dict[str, list[int]] = {}
    for f in sorted(facts, key=lambda f: f.rank):
        by_host.setdefault(f.host, []).append(f.rank)
    lines = [
        f"world {len(facts)} rank(s) on {nodes} node(s); hosts: "
        + ", ".join(f"{h} (ranks {_span(r)})" for h, r in by_host.items())
    ]
    for what, values in (
        ("backend", {f.backend for f in facts}),
        ("devices", {f.device.split(":")[0] for f in facts}),
        ("interfaces", {f"{f.interface or '?'} ({f.interface_source})" for f in facts}),
    ):
        lines.append(f"{what}: {', '.join(sorted(values))}")
    return lines


def _span(ranks: list[int]) -> str:
    return (
        f"{ranks[0]}-{ranks[-1]}"
        if len(ranks) > 1 and ranks[-1] - ranks[0] == len(ranks) - 1
        else ",".join(map(str, ranks))
    )

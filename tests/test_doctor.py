"""`python -m zeta_fsdp doctor`: the pure checks on made-up facts, then real launches on CPU — a
2-rank torchrun that passes, two nodes in Linux network namespaces joined by a veth pair, two
"nodes" that rendezvous on one host, and launches that hang today (a rank that never comes).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, launches, rank_env

from zeta_fsdp.cli.doctor_checks import (
    LinkResult,
    RankFacts,
    all_problems,
    check_arrivals,
    check_device,
    check_hosts,
    check_interface,
    check_links,
    check_master_addr,
    check_world,
    node_count,
    slowest_at_collective,
)

DOCTOR = [sys.executable, "-m", "zeta_fsdp", "doctor"]


def _facts(world: int, per_node: int, hosts: list[str], **kw) -> list[RankFacts]:
    return [
        RankFacts(r, world, local_rank=r % per_node, local_world_size=per_node, host=hosts[r // per_node], **kw)
        for r in range(world)
    ]


# ------------------------------------------------------------------ the pure checks


def test_a_good_two_node_job_has_no_problem():
    facts = _facts(4, 2, ["a", "b"], nnodes=2, master_addr="10.0.0.1", interface="eth0")
    assert all_problems(facts, world_size=4, master_resolved=["10.0.0.1"], timeout_s=5, slow_s=5) == []


def test_world_size_must_be_nodes_times_processes_per_node():
    facts = _facts(4, 2, ["a", "b"])
    assert check_world(facts, 4, 2) == []
    (line,) = check_world(facts, 4, 2, nproc_per_node=4)
    assert line == "world size 4 != 2 node(s) x 4 process(es) per node = 8"
    mixed = facts[:2] + [RankFacts(2, 4, local_world_size=1, host="b")]
    assert any("LOCAL_WORLD_SIZE [1, 2]" in p for p in check_world(mixed, 3, 2))
    twice = facts + [RankFacts(1, 4, local_world_size=2, host="c")]
    assert any("RANK 1 is used twice (a and c)" in p for p in check_world(twice, 4, 2))


def test_nodes_come_from_the_launcher_else_the_node_ranks_else_the_hosts():
    assert node_count(_facts(4, 2, ["a", "b"])) == 2  # hosts
    assert node_count(_facts(4, 2, ["a", "a"], nnodes=2)) == 2  # GROUP_WORLD_SIZE / SLURM_NNODES
    assert node_count(_facts(4, 2, ["a", "b"]), expected=4) == 4  # --nnodes


def test_every_node_rendezvoused_with_itself_is_named():
    facts = _facts(4, 2, ["a", "a"])
    problems = check_hosts(facts, 2)
    assert problems[0].startswith("the job has 2 nodes but its ranks run on 1 host(s) (a)")
    assert "ranks 0 and 2 on a both have LOCAL_RANK=0" in problems[1]
    assert check_hosts(_facts(4, 2, ["a", "b"]), 2) == []


def test_a_loopback_rendezvous_address_is_a_problem_only_with_several_nodes():
    assert check_master_addr("127.0.0.1", ["127.0.0.1"], 1) == []
    assert "loopback address, localhost (127.0.0.1)" in check_master_addr("localhost", ["127.0.0.1"], 2)[0]
    assert check_master_addr("head", ["127.0.1.1"], 2)  # a name /etc/hosts maps to loopback
    assert check_master_addr("head", ["10.1.2.3"], 2) == []


def test_each_rank_must_see_its_device_and_the_backend_must_fit():
    ok = RankFacts(1, 2, local_rank=1, device="cuda:1", cuda_count=2, backend="nccl")
    assert check_device(ok) == []
    beyond = RankFacts(1, 2, local_rank=1, host="g", device="cuda:1", cuda_count=1, cuda_visible="0", backend="nccl")
    (line,) = check_device(beyond)
    assert line.startswith("rank 1 on g: LOCAL_RANK=1 but it sees 1 CUDA device(s) (CUDA_VISIBLE_DEVICES='0')")
    assert "needs a CUDA device" in check_device(RankFacts(0, 2, device="cpu", backend="nccl"))[0]


def test_the_interface_must_exist_and_not_be_loopback_across_nodes():
    lo = RankFacts(
        0, 2, host="h", interface="lo", interface_source="hostname 'h' resolves to 127.0.1.1", interface_loopback=True
    )
    assert check_interface(lo, 1) == []
    assert "set GLOO_SOCKET_IFNAME" in check_interface(lo, 2)[0]
    lo.backend = "nccl"
    assert "set NCCL_SOCKET_IFNAME" in check_interface(lo, 2)[0]
    gone = RankFacts(0, 2, host="h", interface="eth9", interface_source="GLOO_SOCKET_IFNAME", interface_missing=True)
    assert check_interface(gone, 1) == [
        "rank 0 on h: GLOO_SOCKET_IFNAME names no network interface of this host (eth9)"
    ]


def test_missing_and_late_ranks_are_named():
    facts = [RankFacts(0, 4, arrived=100.0), RankFacts(2, 4, arrived=100.5), RankFacts(3, 4, host="n3", arrived=108.0)]
    missing, late = check_arrivals(facts, 4, 10, 5)
    assert missing.startswith("rank(s) [1] of 4 did not arrive within 10 s (arrived: [0, 2, 3])")
    assert late == "rank 3 on n3 arrived 8.0 s after the first rank (slow start)"
    assert check_arrivals(facts[:2], 2, 10, 5) == [
        "rank(s) [1] of 2 did not arrive within 10 s (arrived: [0, 2]): not started, or stuck before the check"
    ]


def test_the_slowest_rank_waits_least_in_a_collective():
    assert slowest_at_collective([0.3, 0.3, 0.0, 0.29]) == (2, pytest.approx(0.295))


def test_a_link_slower_than_its_kind_is_named_and_kinds_are_not_mixed():
    mib = 2**20
    intra = [LinkResult(r, r + 1, mib, 0.001, ("a", "a")) for r in range(3)]
    inter = [LinkResult(3, 4, mib, 0.01, ("a", "b")), LinkResult(7, 0, mib, 0.01, ("b", "a"))]
    assert check_links(intra + inter) == []  # inter-node links 10x slower: by design
    slow = LinkResult(4, 5, mib, 0.01, ("b", "b"))
    (line,) = check_links(intra + inter + [slow])
    assert line.startswith("slow link rank 4 (b) -> rank 5 (b): 0.105 GB/s, median of intra-node links")
    failed = LinkResult(1, 2, mib, None, ("a", "b"), "timed out")
    assert check_links([failed]) == ["link rank 1 (a) -> rank 2 (b) failed: timed out"]


# ------------------------------------------------------------------ real launches


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _doctor_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("doctor: ")]


@pytest.mark.launch
def test_two_ranks_under_torchrun_pass_with_measured_links():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "zeta_fsdp", "doctor", "--timeout", "60", "--slow", "60", "--mib", "1"]
    cmd += ["--model", "zeta_fsdp.models.gpt:small"]  # its first step too, every forward checked
    proc = subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300)
    lines = _doctor_lines(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert lines[0] == f"doctor: world 2 rank(s) on 1 node(s); hosts: {socket.gethostname()} (ranks 0-1)"
    assert lines[-1] == "doctor: all checks passed"
    model_line = "doctor: model zeta_fsdp.models.gpt:small: 5 FSDP units (FULL_SHARD); every rank ran the same units"
    assert any(line.startswith(model_line) for line in lines), lines
    for prefix in (
        "doctor: all_reduce 1.0 MiB:",
        "doctor: all_gather 1.0 MiB:",
        "doctor: link rank 0 ",
        "doctor: link rank 1 ",
    ):
        assert any(line.startswith(prefix) and "GB/s" in line for line in lines), (prefix, lines)


_SKIPPER = """
import torch
import torch.distributed as dist
from zeta_fsdp.models.gpt import GPT, GPTConfig


class Skipper(GPT):
    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.blocks):
            if not (i == 1 and dist.get_rank() == 1):  # rank 1 skips blocks.1: nothing to read says so
                x = block(x, self.causal_mask)
        return self.head(self.norm(x))


def build():
    return Skipper(GPTConfig())
"""


@pytest.mark.launch
def test_a_models_first_step_names_the_unit_a_rank_skips(tmp_path):
    (tmp_path / "skipper.py").write_text(_SKIPPER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "zeta_fsdp", "doctor", "--timeout", "60", "--slow", "60", "--mib", "1", "--model", "skipper:build"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=rank_env(), capture_output=True, text=True, timeout=300)
    lines = _doctor_lines(proc.stdout)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    problem = "doctor: PROBLEM: fsdp(): ranks diverged in forward #1: they were about to run different FSDP units "
    assert problem + "(rank 0: blocks.1 (train mode), rank 1: blocks.2 (train mode); this is rank 0)" in lines, lines
    assert lines[-1] == "doctor: 1 problem(s)", lines


def _srun_style(rank: int, world: int, port: int, *args: str) -> subprocess.Popen:
    """One rank started the way a plain ``srun`` starts it: the launcher variables, no torchrun."""
    env = rank_env() | {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
    env |= {"LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen(
        [*DOCTOR, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.launch
def test_a_rank_that_never_comes_is_named_in_seconds_not_after_30_minutes():
    # WORLD_SIZE=2, one process: init_process_group would wait its 30-minute timeout.
    start = time.monotonic()
    proc = _srun_style(0, 2, _free_port(), "--timeout", "3")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, out + err
    assert "doctor: PROBLEM: rank(s) [1] of 2 did not arrive within 3 s (arrived: [0])" in out, out
    assert _doctor_lines(out)[-1] == "doctor: 1 problem(s)"
    assert time.monotonic() - start < 60  # the 3 s wait plus start-up on a loaded machine


@pytest.mark.launch
def test_a_late_rank_is_named_and_every_rank_exits_nonzero():
    port = _free_port()
    first = _srun_style(0, 2, port, "--timeout", "60", "--slow", "2")
    time.sleep(8)  # rank 1 starts late (a slow node, a stuck import)
    second = _srun_style(1, 2, port, "--timeout", "60")
    out0, err0 = first.communicate(timeout=120)
    out1, err1 = second.communicate(timeout=120)
    assert (first.returncode, second.returncode) == (1, 1), out0 + err0 + out1 + err1
    assert any(
        line.startswith("doctor: PROBLEM: rank 1 on ") and "after the first rank (slow start)" in line
        for line in _doctor_lines(out0)
    ), out0
    assert out1 == "" and "Traceback" not in err1, err1  # rank 0 alone reports


def _torchrun_node(
    node_args: list[str], *doctor_args: str, prefix: list[str] = (), env: dict = None
) -> subprocess.Popen:
    cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    cmd += [*node_args, "-m", "zeta_fsdp", "doctor", *doctor_args]
    env = env or rank_env()
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.launch
def test_two_nodes_that_are_one_host_on_loopback_are_refused():
    # Two torchruns on one host, a c10d rendezvous on 127.0.0.1: what a job looks like when every
    # "node" is the same machine. Each problem gets its own line; both launches exit non-zero.
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "loop"]
    nodes = [_torchrun_node(rdzv, "--timeout", "60", "--slow", "60") for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [1, 1], outs
    lines = _doctor_lines("".join(out for out, _ in outs))
    assert any(
        line.startswith("doctor: PROBLEM: the job has 2 nodes but its ranks run on 1 host(s)") for line in lines
    ), lines
    assert any("LOCAL_RANK=0" in line and "both have" in line for line in lines), lines
    assert any("rendezvous endpoint is a loopback address" in line for line in lines), lines


# --- two nodes in network namespaces joined by a veth pair (root + iproute2 + unshare)


def _netns_available() -> str:
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "needs iproute2 and util-linux unshare"
    return ""


@pytest.fixture
@launches
def two_nodes():
    """Two network namespaces (each a "node" with its own interface and address) joined by a veth pair.

    Yields ``(namespaces, interfaces, addresses, write_hosts)``; ``write_hosts(loopback)`` gives each
    node an /etc/hosts (``ip netns exec`` mounts /etc/netns/<ns>/hosts over it) mapping the hostnames
    ``node0``/``node1`` to the veth addresses, or to 127.0.1.1 as Debian's installer writes it.
    """
    why = _netns_available()
    if why:
        pytest.skip(f"two simulated nodes: {why}")
    tag = uuid.uuid4().hex[:6]
    ns, veth, addr = [f"zd{tag}a", f"zd{tag}b"], [f"zd{tag}va", f"zd{tag}vb"], ["10.213.7.1", "10.213.7.2"]
    setup = [["ip", "netns", "add", ns[0]], ["ip", "netns", "add", ns[1]]]
    setup.append(["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]])
    for i in (0, 1):
        setup.append(["ip", "link", "set", veth[i], "netns", ns[i]])
        setup.append(["ip", "-n", ns[i], "addr", "add", f"{addr[i]}/24", "dev", veth[i]])
        setup += [["ip", "-n", ns[i], "link", "set", veth[i], "up"], ["ip", "-n", ns[i], "link", "set", "lo", "up"]]
    etc = [Path("/etc/netns") / name for name in ns]

    def write_hosts(loopback: bool) -> None:
        for i, folder in enumerate(etc):
            folder.mkdir(parents=True, exist_ok=True)
            own = f"127.0.1.1 node{i}" if loopback else f"{addr[i]} node{i}"
            other = f"{addr[1 - i]} node{1 - i}"
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{own}\n{other}\n")

    try:
        for cmd in setup:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                pytest.skip(f"two simulated nodes: {' '.join(cmd)} failed: {proc.stderr.strip()}")
        yield ns, veth, addr, write_hosts
    finally:
        for name, folder in zip(ns, etc):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(folder, ignore_errors=True)


def _in_node(ns: str, hostname: str) -> list[str]:
    # its own network namespace, and a UTS namespace with its own hostname
    return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh"]


def _launch_two_nodes(ns, addr, rdzv_id: str, envs: list[dict], *, host_flag: bool = False) -> list[tuple[str, str]]:
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr[0]}:29555", "--rdzv-id", rdzv_id]
    nodes = []
    for i in (0, 1):
        node_args = [*rdzv, "--local-addr", addr[i]]
        if host_flag and i == 0:  # torchrun cannot tell it hosts the endpoint when its hostname is loopback
            node_args += ["--rdzv-conf", "is_host=1"]
        args = ("--timeout", "60", "--slow", "60", "--mib", "1")
        nodes.append(_torchrun_node(node_args, *args, prefix=_in_node(ns[i], f"node{i}"), env=rank_env() | envs[i]))
    outs = [p.communicate(timeout=300) for p in nodes]
    return [(p.returncode, out, err) for p, (out, err) in zip(nodes, outs)]


@pytest.mark.launch
def test_two_nodes_in_network_namespaces_pass(two_nodes):
    ns, veth, addr, write_hosts = two_nodes
    write_hosts(loopback=False)
    # node0: gloo's own pick (its hostname's address); node1: GLOO_SOCKET_IFNAME
    results = _launch_two_nodes(ns, addr, "pass", [{}, {"GLOO_SOCKET_IFNAME": veth[1]}])
    assert [rc for rc, _, _ in results] == [0, 0], results
    lines = _doctor_lines(results[0][1] + results[1][1])
    assert "doctor: world 2 rank(s) on 2 node(s); hosts: node0 (ranks 0), node1 (ranks 1)" in lines, lines
    interfaces = (
        f"doctor: interfaces: {veth[0]} (hostname 'node0' resolves to {addr[0]}), {veth[1]} (GLOO_SOCKET_IFNAME)"
    )
    assert interfaces in lines, lines
    assert any(line.startswith("doctor: link rank 0 (node0) -> rank 1 (node1):") for line in lines), lines
    assert lines[-1] == "doctor: all checks passed"


@pytest.mark.launch
def test_two_nodes_whose_hostname_maps_to_loopback_are_told_which_interface_to_set(two_nodes):
    # Debian's /etc/hosts maps the hostname to 127.0.1.1: gloo would bind the loopback and the
    # first collective would hang until its timeout; doctor says so before any collective.
    ns, veth, addr, write_hosts = two_nodes
    write_hosts(loopback=True)
    results = _launch_two_nodes(ns, addr, "loop", [{}, {}], host_flag=True)
    assert [rc for rc, _, _ in results] == [1, 1], results
    lines = _doctor_lines(results[0][1] + results[1][1])
    for i in (0, 1):
        expected = f"doctor: PROBLEM: rank {i} on node{i}: gloo will use the loopback interface (hostname 'node{i}' resolves to 127.0.1.1"
        assert any(line.startswith(expected) and "set GLOO_SOCKET_IFNAME" in line for line in lines), lines
    assert not any("all_reduce" in line for line in lines), lines  # refused before any collective

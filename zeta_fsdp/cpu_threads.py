"""CPU ranks on one machine share its cores: each gets ``cores // local ranks`` intra-op threads.

torch gives every process as many threads as the machine has cores, so N ranks on one node run N
times too many threads (peers measured ~10x slower CPU AdamW with 8 ranks on 2 cores). When
``fsdp()`` starts the process group of CPU ranks (or of ranks that offload to CPU), it calls
:func:`share_cores`, which leaves the setting alone if the user chose it: ``OMP_NUM_THREADS`` set
(by the user: torchrun's own default of 1 for several local ranks is replaced by the fair share)
or ``torch.set_num_threads`` called after ``zeta_fsdp`` was imported.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["fair_share", "local_ranks", "share_cores"]

# The thread count we last saw or set: a later difference means the user called torch.set_num_threads.
_AT_IMPORT = torch.get_num_threads()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on (what `nproc` prints)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def local_ranks() -> int:
    """Ranks on this machine: torchrun's ``LOCAL_WORLD_SIZE``, SLURM's tasks per node, else 1."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def fair_share(cores: Optional[int] = None, ranks: Optional[int] = None) -> int:
    """``max(1, cores // ranks)``: this rank's threads.

    Example:
        >>> fair_share(cores=16, ranks=8), fair_share(cores=2, ranks=8)
        (2, 1)
    """
    return max(1, (cores or _cores()) // (ranks or local_ranks()))


def _omp_set_by_torchrun() -> bool:
    """torchrun sets ``OMP_NUM_THREADS=1`` for several local ranks when its own environment lacks it: the
    agent's starting environment (``/proc/<agent>/environ``: putenv does not change it) tells the two apart."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return False
    return not any(entry.startswith(b"OMP_NUM_THREADS=") for entry in entries)


def _user_chose() -> bool:
    if "OMP_NUM_THREADS" in os.environ and not _omp_set_by_torchrun():
        return True
    return torch.get_num_threads() != _AT_IMPORT


def share_cores(device: torch.device, cpu_offload: bool = False) -> Optional[int]:
    """Set this rank's intra-op threads to its fair share of the machine's cores when it computes or steps
    on CPU and the user did not choose; returns the threads set, or ``None`` (left alone).

    Example:
        >>> share_cores(torch.device("cuda"))  # GPU ranks without offload: nothing to share
    """
    global _AT_IMPORT
    if (device.type != "cpu" and not cpu_offload) or _user_chose():
        return None
    threads = fair_share()
    torch.set_num_threads(threads)
    _AT_IMPORT = threads  # ours: a change from here on is the user's
    return threads

"""`DistEnv`: where this process stands in the job (rank, world size, device, backend).

Read from the variables of the launcher that started this process, or built by
`partrain.launch`. `external_job` reads them, whichever launcher set them:

- torchrun (and Ray Train, which has also made the process group when the
  train function starts: partrain joins that group, see `partrain.ray`): RANK,
  WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
- Kubeflow's PyTorchJob: the same without LOCAL_RANK (one process per pod:
  local rank 0 of 1);
- Slurm's ``srun``: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, the
  tasks per node, the first host of the node list as master, a port derived from
  SLURM_JOB_ID (`slurm_port`) unless MASTER_PORT is set.

torchrun's variables win over Slurm's (torchrun inside an sbatch allocation).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UsageError

#: seconds for every rendezvous, collective and queue wait unless the caller says otherwise
DEFAULT_TIMEOUT = 300.0


@dataclass(frozen=True)
class DistEnv:
    """One process's place in the job.

    ``rank``/``world_size`` count every process of the job (servers too, for
    strategies that start some); a strategy maps them to worker ranks.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = "gloo"

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the process that logs, writes files, shows progress."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_environ(cls, backend: str | None = None, device: str | None = None) -> DistEnv:
        """Read the launcher's variables (`external_job`); a plain ``python script.py`` gives rank 0 of 1."""
        job = external_job()
        if job is None:
            dev = pick_device(0, device)
            return cls(0, 1, 0, 1, dev, backend or default_backend(dev))
        dev = pick_device(job.local_rank, device)
        return cls(job.rank, job.world_size, job.local_rank, job.local_world_size, dev,
                   backend or default_backend(dev))


@dataclass(frozen=True)
class ExternalJob:
    """A job some other launcher started, as its environment variables describe it.

    ``launcher``: "torchrun" (or anything setting LOCAL_RANK too: Ray Train), "kubernetes"
    (RANK/WORLD_SIZE without LOCAL_RANK: Kubeflow's PyTorchJob) or "slurm" (``srun``).
    ``master_addr``/``master_port``: where the job's store is (rank 0 hosts it unless
    torchrun's agent does); None when not given (a process `partrain.launch` spawned).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None

    @property
    def joinable(self) -> bool:
        """True when this process must join the job, not start one: there is a master to meet at,
        or the launcher has already made the process group (Ray Train's ``init_method="tcp"``
        sets RANK/WORLD_SIZE and the group but no MASTER_ADDR)."""
        if self.master_addr is not None:
            return True
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()


#: first port `slurm_port` gives, and how many it spreads job ids over
SLURM_PORT_BASE, SLURM_PORT_SPAN = 10000, 50000


def slurm_port(job_id: int) -> int:
    """The store's port for a Slurm job when MASTER_PORT is unset: 10000 + job_id % 50000.

    Every task of the job computes the same port with no exchange; two jobs sharing a
    first node collide only when their ids are 50000 apart. Set MASTER_PORT to choose.
    """
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def external_job(environ: Mapping[str, str] | None = None) -> ExternalJob | None:
    """This process's place in a job another launcher started, or None (we start the job).

    torchrun's variables (RANK, WORLD_SIZE, ...) come first; else an ``srun`` step of more
    than one task (SLURM_STEP_ID and SLURM_PROCID set, SLURM_NTASKS > 1). A batch script
    (no step) or a one-task step is not such a job: partrain starts its own processes there.
    Variables that contradict each other raise `UsageError` naming them.
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _torchrun_job(environ)
    if "SLURM_PROCID" in environ and ("SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ):
        return _slurm_job(environ)
    return None


def external_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """"torchrun", "kubernetes" or "slurm" when this process must join a job that launcher started, else None."""
    job = external_job(environ)
    return job.launcher if job is not None and job.joinable else None


def global_rank_from_environ(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank as its launcher's variables give it; 0 when none started it."""
    job = external_job(environ)
    return 0 if job is None else job.rank


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"Expected an integer in ${name}. Received: {raw!r}") from None


def _torchrun_job(environ: Mapping[str, str]) -> ExternalJob:
    rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    if rank is None or world is None:
        raise UsageError(f"Expected RANK and WORLD_SIZE together. Received: RANK={environ.get('RANK')!r}, "
                         f"WORLD_SIZE={environ.get('WORLD_SIZE')!r}")
    if world < 1 or not 0 <= rank < world:
        raise UsageError(f"Expected 0 <= RANK < WORLD_SIZE. Received: RANK={rank}, WORLD_SIZE={world}")
    if "LOCAL_RANK" in environ:
        launcher = "torchrun"
        local_rank = _int(environ, "LOCAL_RANK", 0)
        local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
    else:  # Kubeflow's PyTorchJob: one process per pod
        launcher = "kubernetes"
        local_rank, local_world = 0, _int(environ, "LOCAL_WORLD_SIZE", 1)
    assert local_rank is not None and local_world is not None
    if not 0 <= local_rank < local_world <= world:
        raise UsageError(f"Expected 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE. Received: "
                         f"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world}, WORLD_SIZE={world}")
    addr = environ.get("MASTER_ADDR") or None
    port = _int(environ, "MASTER_PORT")
    if addr is not None and port is None:
        raise UsageError(f"Expected MASTER_PORT with MASTER_ADDR. Received: MASTER_ADDR={addr!r}, "
                         f"MASTER_PORT={environ.get('MASTER_PORT')!r}")
    _check_port(port, "MASTER_PORT")
    return ExternalJob(launcher, rank, world, local_rank, local_world, addr, port)


def _slurm_job(environ: Mapping[str, str]) -> ExternalJob | None:
    rank, world = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
    if world is None:
        raise UsageError(f"Expected SLURM_NTASKS with SLURM_PROCID. Received: "
                         f"SLURM_PROCID={environ.get('SLURM_PROCID')!r}, SLURM_NTASKS=None")
    assert rank is not None
    if world < 1 or not 0 <= rank < world:
        raise UsageError(f"Expected 0 <= SLURM_PROCID < SLURM_NTASKS. Received: SLURM_PROCID={rank}, "
                         f"SLURM_NTASKS={world}")
    if world == 1:  # a one-task step: partrain starts its workers inside it
        return None
    local_rank, node = _int(environ, "SLURM_LOCALID", 0), _int(environ, "SLURM_NODEID", 0)
    assert local_rank is not None and node is not None
    name = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
                 if environ.get(n)), None)
    if name is None:
        raise UsageError("Expected SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE "
                         "in an srun step. Received: none")
    per_node = parse_tasks_per_node(environ[name], name)
    if len(per_node) == 1 and name == "SLURM_NTASKS_PER_NODE":  # one count for every node
        per_node = per_node * max(1, -(-world // per_node[0]))
    elif sum(per_node) != world:
        raise UsageError(f"Expected ${name} to add up to SLURM_NTASKS={world}. Received: "
                         f"{environ[name]!r} ({sum(per_node)} tasks)")
    if not 0 <= node < len(per_node):
        raise UsageError(f"Expected 0 <= SLURM_NODEID < {len(per_node)} (the nodes in ${name}). "
                         f"Received: SLURM_NODEID={node}")
    local_world = per_node[node]
    if not 0 <= local_rank < local_world:
        raise UsageError(f"Expected 0 <= SLURM_LOCALID < {local_world} (tasks on node {node} in ${name}). "
                         f"Received: SLURM_LOCALID={local_rank}")
    addr = environ.get("MASTER_ADDR") or None
    if addr is None:
        nodes = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                      if environ.get(n)), None)
        if nodes is None:
            raise UsageError("Expected MASTER_ADDR or SLURM_JOB_NODELIST in an srun step. Received: neither")
        addr = parse_hostlist(environ[nodes], nodes)[0]
    port = _int(environ, "MASTER_PORT")
    if port is None:
        job_id = _int(environ, "SLURM_JOB_ID", _int(environ, "SLURM_JOBID"))
        if job_id is None:
            raise UsageError("Expected MASTER_PORT or SLURM_JOB_ID in an srun step. Received: neither")
        port = slurm_port(job_id)
    _check_port(port, "MASTER_PORT")
    return ExternalJob("slurm", rank, world, local_rank, local_world, addr, port)


def _check_port(port: int | None, name: str) -> None:
    if port is not None and not 0 < port < 65536:
        raise UsageError(f"Expected a port between 1 and 65535 in ${name}. Received: {port}")


_HOST_ITEM = re.compile(r"([^\[\],]+)(?:\[([^\[\]]*)\])?([^\[\],]*)")


def parse_hostlist(text: str, name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Slurm's compressed host list, expanded: "node[01-03,07],gpu-b3" -> node01..node03, node07, gpu-b3.

    A range keeps its zero padding ("01-03" gives 01, 02, 03). One bracket per name
    (what Slurm writes for the node lists it sets). ``name`` is for the error line.
    """
    hosts: list[str] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        match = _HOST_ITEM.match(text, pos)
        if match is None or match.end() == pos:
            raise UsageError(f"Expected a Slurm host list such as node[01-04,07],gpu-b3 in ${name}. "
                             f"Received: {text!r}")
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            hosts.append(prefix + suffix)
        else:
            for part in ranges.split(","):
                lo, sep, hi = part.partition("-")
                if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
                    raise UsageError(f"Expected a Slurm host list such as node[01-04,07],gpu-b3 in ${name}. "
                                     f"Received: {text!r}")
                for i in range(int(lo), int(hi if sep else lo) + 1):
                    hosts.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
        pos = match.end()
        if pos < len(text):
            if text[pos] != ",":
                raise UsageError(f"Expected a Slurm host list such as node[01-04,07],gpu-b3 in ${name}. "
                                 f"Received: {text!r}")
            pos += 1
    if not hosts:
        raise UsageError(f"Expected a Slurm host list such as node[01-04,07],gpu-b3 in ${name}. Received: {text!r}")
    return hosts


_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def parse_tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's tasks per node, one count per node: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _TASKS_ITEM.fullmatch(item.strip())
        if match is None or int(match.group(1)) < 1 or (match.group(2) and int(match.group(2)) < 1):
            raise UsageError(f"Expected tasks per node such as 2(x3),1 in ${name}. Received: {text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def in_torchrun() -> bool:
    """True when torchrun, Slurm's srun, a PyTorchJob or Ray started this process: join, do not spawn."""
    return external_launcher() is not None


def pick_device(local_rank: int, device: str | None = None) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is there (and not refused), else the CPU."""
    if device is not None and device != "auto":
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def check_device(device: str | None = None, backend: str | None = None) -> None:
    """One line, before any process starts, for a device or backend this machine cannot give.

    ``device``: None or "auto" (CUDA when present), "cpu", "cuda", "cuda:N"...;
    ``backend``: a torch.distributed backend ("gloo", "nccl", ...). NCCL needs CUDA.
    """
    dev = None
    if device is not None and device != "auto":
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise UsageError(f"Expected a device such as cpu, cuda, cuda:1 or auto. Received: {device!r}") from None
        if dev.type == "cuda":
            check_cuda_device(dev, f"--device {device}")
    if backend is None:
        return
    import torch.distributed as dist

    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    if backend not in known:
        raise UsageError(f"Expected a backend among {', '.join(known)}. Received: {backend!r}")
    if backend == "nccl":
        check_cuda("--backend nccl")
        if dev is not None and dev.type != "cuda":
            raise UsageError(f"Expected --device cuda with --backend nccl. Received: --device {device}")


def gpus_for(device: str | None) -> int:
    """How many distinct GPUs the processes of one machine get under ``device`` (0: none).

    "auto" / None / "cuda": every visible one (rank r takes ``cuda:r % count``);
    "cuda:N": that one only; "cpu": none.
    """
    if not torch.cuda.is_available():
        return 0
    if device is None or device == "auto":
        return torch.cuda.device_count()
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    return 1 if dev.index is not None else torch.cuda.device_count()


def check_ranks_per_gpu(ranks: int, device: str | None = None, backend: str | None = None) -> None:
    """One line when NCCL would put two of this machine's ``ranks`` on one GPU.

    NCCL refuses that ("invalid usage" at the first collective, seen on a 1-GPU H100
    machine with 2 workers); gloo accepts it (its collectives copy through the host).
    """
    gpus = gpus_for(device)
    if gpus == 0 or (backend or "nccl") != "nccl" or ranks <= gpus:
        return
    raise UsageError(f"Expected at most {gpus} worker(s) per machine with NCCL, one per GPU ({gpus} visible "
                     f"for --device {device or 'auto'}). Received: {ranks} workers; use --workers {gpus}, or "
                     f"--backend gloo to share a GPU, or --device cpu")


def check_cuda(what: str) -> None:
    """One line when ``what`` needs CUDA and this machine has none."""
    if not torch.cuda.is_available():
        raise UsageError(f"Expected a CUDA device for {what}. Received: none visible "
                         f"(torch.cuda.is_available() is False)")


def check_cuda_device(device: torch.device, what: str) -> None:
    """One line when CUDA ``device`` (``cuda`` or ``cuda:N``) is not there: no CUDA, or N past the last GPU."""
    check_cuda(what)
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise UsageError(f"Expected a visible CUDA device for {what}. Received: {count} visible "
                         f"(cuda:0 to cuda:{count - 1})")


def default_backend(device: torch.device) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"


def process_started_at() -> float | None:
    """The wall-clock time (``time.time()``'s clock) at which this process started, to about 10 ms;
    None where /proc does not say (not Linux). Start-up figures count from it: the interpreter's
    start and the imports are part of what a user waits for."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - max(0.0, age)


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota.

    ``os.cpu_count()`` counts the host's cores; under ``taskset``, a container limit
    (Docker ``--cpus``, Kubernetes CPU limits) or Slurm's ``--cpus-per-task`` that
    oversubscribes. ``PARTRAIN_CORES`` overrides both (a positive integer).
    """
    raw = os.environ.get("PARTRAIN_CORES", "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise UsageError(f"Expected a positive integer in $PARTRAIN_CORES. Received: {raw!r}")
        return value
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows: no affinity mask
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time the cgroup allows per period (``quota / period``), or None.

    Reads cgroup v2's ``cpu.max`` ("max 100000" = no limit) for this process's
    cgroup, else v1's ``cpu.cfs_quota_us`` (-1 = no limit) / ``cpu.cfs_period_us``.
    """
    base = Path(root)
    try:
        v2_path = next((line.split("::", 1)[1].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                        if line.startswith("0::")), "/")
    except OSError:
        v2_path = "/"
    for cpu_max in (base / v2_path.lstrip("/") / "cpu.max", base / "cpu.max"):
        try:
            quota, period = cpu_max.read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else _ratio(quota, period)
    try:
        quota = (base / "cpu" / "cpu.cfs_quota_us").read_text().strip()
        period = (base / "cpu" / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None

"""Who a process is: tenant, job, rank and GPU, read from what the host can see.

The workload is never changed, so identity comes from /proc/<pid>/environ
(launcher variables), /proc/<pid>/cgroup (container and pod) and, when the
agent has them, NVML's per-GPU process lists. Resolving reads a few /proc
files per process, so results are cached per pid and re-resolved only when the
pid now names a different program image (pid reuse or exec).
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass

from fleetscope.config import SECRET_NAME

log = logging.getLogger(__name__)

# First variable present (and an integer) wins. PMI_SIZE pairs with PMI_RANK
# (MPICH, Intel MPI), which would otherwise have a rank but no world size.
RANK_ENV = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
LOCAL_RANK_ENV = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
WORLD_SIZE_ENV = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")

# Names for Identity.source; any other job variable reports as "env:NAME".
_JOB_SOURCE = {"TORCHELASTIC_RUN_ID": "torchelastic", "SLURM_JOB_ID": "slurm",
               "OMPI_MCA_orte_ess_jobid": "mpi", "PMIX_NAMESPACE": "mpi"}
# torchrun's --rdzv-id defaults to the literal "none"; every static-rendezvous
# job would share it, so it identifies nothing.
_MEANINGLESS_JOB_IDS = {"", "none"}
_LOOPBACK_ADDRS = {"localhost", "::1", "ip6-localhost"}

# A path component that is a 64-hex container id, bare (cgroupfs: /docker/<id>,
# /kubepods/.../<id>) or as a systemd scope (docker-, cri-containerd-, crio-,
# libpod-<id>.scope). crio-conmon-<id> is CRI-O's monitor, not the container,
# and deliberately does not match.
_CONTAINER_ID = re.compile(
    r"(?:^|/)(?:(?:docker|cri-containerd|containerd|crio|libpod)-)?([0-9a-f]{64})(?:\.scope)?(?=/|$)")
# containerd without CRI may name a container anything under /containerd/.
_CONTAINERD_NAME = re.compile(r"/containerd/([^/]+)")
# kubepods pod uid: dashes under cgroupfs, underscores under the systemd
# driver; static (mirror) pods use a 32-hex config hash with no separators.
_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{12})(?![0-9a-f])")

# What may become a published tenant or job name: the key is `tenant/job`, and names reach dashboards,
# remediation commands and every reader of the topics. No slashes, no spaces, no leading '_' (the
# reserved `_node` tenant), bounded length. A value that fails is ignored (counted), never published.
NAME_SHAPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}")
NODE_TENANT = "_node"  # fleetscope.schema.NODE_TENANT: the node's own events; no process may claim it


def publishable_name(value: str) -> bool:
    return bool(NAME_SHAPE.fullmatch(value)) and value != NODE_TENANT


_GONE = (errno.ENOENT, errno.ESRCH)
_DENIED = (errno.EACCES, errno.EPERM)


@dataclass(frozen=True)
class Identity:
    tenant: str
    job: str
    rank: int = -1
    local_rank: int = -1
    world_size: int = -1
    gpu: int = -1  # NVML's answer when given; else the first index in CUDA_VISIBLE_DEVICES
    visible_devices: tuple[str, ...] = ()
    container: str = ""
    pod: str = ""
    namespace: str = ""  # the pod's, from the kubelet or the node mapping (trusted), when known
    pod_name: str = ""
    container_name: str = ""
    master_addr: str = ""
    source: str = "none"  # which rule decided the job: torchelastic, slurm, mpi, env:NAME, rendezvous, none

    def placement(self) -> tuple[str, str, str]:
        """(pod, namespace, container) as rows carry them (fleetscope.schema.PLACEMENT_COLUMNS): the pod's
        and the container's names where the kubelet or the node mapping gave them, else the pod UID and the
        short container id the cgroup names; "" where the process has none."""
        return self.pod_name or self.pod, self.namespace, self.container_name or self.container


@dataclass
class IdentityRules:
    """How a process maps to a tenant and a job; operators configure these."""

    tenant_env: str | None = "FLEETSCOPE_TENANT"
    # A cgroup names the pod uid but not its namespace; the agent supplies the
    # lookup (e.g. from the kubelet or a namespace label) through tenant_by_pod.
    tenant_from_namespace: bool = True
    tenant_by_pod: Callable[[str], str | None] | None = None
    default_tenant: str = "default"
    job_env: tuple[str, ...] = ("FLEETSCOPE_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                                "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE")
    # Whether the workload's own tenant_env may name its tenant (after every trusted source). Off unless the
    # operator says so: a workload must not choose its own tenant.
    tenant_env_trusted: bool = False
    # The operator's trusted sources (kubelet pod list, node mapping file): a TenantSources.
    sources: object | None = None
    rejected: dict = dataclasses.field(default_factory=lambda: {"tenant": 0, "job": 0})

    def __post_init__(self) -> None:
        for name in (*self.job_env, self.tenant_env or ""):
            if name and SECRET_NAME.search(name):
                raise ValueError(f"identity variable {name} looks like a secret (SECRET, TOKEN, PASSWORD, KEY): "
                                 f"its value would be published as a job or tenant name; name another variable")

    def tenant(self, env: dict[str, str], pod: str, cgroup_paths: list[str] | None = None) -> str:
        # The platform's mapping outranks the environment: a workload can set
        # its own variables, but not the namespace it was scheduled into.
        if self.tenant_from_namespace and self.tenant_by_pod and pod:
            try:
                mapped = self.tenant_by_pod(pod)
            # The hook is the operator's code (a kubelet or API lookup); its
            # failure must not cost the event its identity.
            except Exception as e:  # noqa: BLE001
                log.debug("identity: tenant_by_pod(%s) failed: %s", pod, e)
                mapped = None
            if mapped and self._publishable("tenant", mapped):
                return mapped
        if self.sources is not None:
            trusted = self.sources.tenant(pod if self.tenant_from_namespace else "", cgroup_paths or [], env)
            if trusted and self._publishable("tenant", trusted):
                return trusted
        claimed = env.get(self.tenant_env, "").strip() if self.tenant_env and self.tenant_env_trusted else ""
        if claimed and self._publishable("tenant", claimed):
            return claimed
        return self.default_tenant

    def _publishable(self, kind: str, value: str) -> bool:
        if publishable_name(value):
            return True
        self.rejected[kind] += 1
        log.debug("identity: %s value of %d characters is not a publishable name; ignored", kind, len(value))
        return False

    def job(self, env: dict[str, str], host: str) -> tuple[str, str]:
        """(job, source)."""
        for name in self.job_env:
            value = env.get(name, "").strip()
            if value.lower() not in _MEANINGLESS_JOB_IDS and self._publishable("job", value):
                return value, _JOB_SOURCE.get(name, f"env:{name}")
        addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
        if addr and port and ("RANK" in env or "WORLD_SIZE" in env):
            # All ranks of one job meet at one rendezvous. A loopback address is
            # the same string on every node, so it names the node instead.
            if addr in _LOOPBACK_ADDRS or addr.startswith("127."):
                addr = host
            job = f"{addr}:{port}"
            if self._publishable("job", job):
                return job, "rendezvous"
        return "", "none"


def parse_environ(raw: bytes) -> dict[str, str]:
    env = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            env[name.decode(errors="replace")] = value.decode(errors="replace")
    return env


def parse_cgroup(text: str) -> tuple[str, str]:
    """(container, pod) from /proc/<pid>/cgroup; "" where the process has none."""
    container = pod = ""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        if not container:
            ids = _CONTAINER_ID.findall(path)
            if ids:
                container = ids[-1][:12]  # innermost when nested; docker's short form
            else:
                names = _CONTAINERD_NAME.findall(path)
                if names:
                    container = names[-1][:12] if re.fullmatch(r"[0-9a-f]{64}", names[-1]) else names[-1]
        if not pod and "kubepods" in path:
            uids = _POD_UID.findall(path)
            if uids:
                pod = uids[-1].replace("_", "-")
    return container, pod


def _first_int(env: dict[str, str], names: tuple[str, ...]) -> int:
    for name in names:
        try:
            return int(env[name].strip())
        except (KeyError, ValueError):
            continue
    return -1


class _Vanished(Exception):
    """The process exited (or its pid now names another one)."""


class _Hidden(Exception):
    """The process exists but /proc will not show it to us."""


class IdentityResolver:
    def __init__(self, rules: IdentityRules | None = None, proc_root: str | os.PathLike = "/proc",
                 nvml_processes: Callable[[], dict[int, int]] | None = None, host: str | None = None):
        self.rules = rules or IdentityRules()
        self.proc_root = os.fspath(proc_root)
        # Should be cheap (e.g. the NVML sampler's latest snapshot): it is
        # consulted on every resolve, since a process gains its GPU context
        # after it starts, long after its identity was first cached.
        self.nvml_processes = nvml_processes
        self.host = host or socket.gethostname()
        self.stats = {"resolved": 0, "cache_hits": 0, "vanished": 0, "permission_denied": 0}
        self._cache: dict[int, tuple[tuple, Identity]] = {}
        self._logged_denied = False
        self._logged_nvml = False

    def resolve(self, pid: int) -> Identity | None:
        """The identity of a live process; None once it is gone (or a zombie)."""
        try:
            key = self._image_key(pid)
            cached = self._cache.get(pid)
            if cached and cached[0] == key:
                self.stats["cache_hits"] += 1
                base = cached[1]
            else:
                base = self._read_identity(pid, key)
                self._cache[pid] = (key, base)
                self.stats["resolved"] += 1
        except _Vanished:
            self._cache.pop(pid, None)
            self.stats["vanished"] += 1
            return None
        except _Hidden:
            # /proc mounted with hidepid: the process exists but shows nothing.
            return Identity(tenant=self.rules.default_tenant, job="")
        return self._with_nvml_gpu(pid, base)

    def forget_dead(self) -> int:
        """Drop cache entries whose pid is gone or now names another image."""
        dead = []
        for pid, (key, _) in list(self._cache.items()):  # resolve() may run alongside
            try:
                if self._image_key(pid) != key:
                    dead.append(pid)
            except (_Vanished, _Hidden):
                dead.append(pid)
        for pid in dead:
            self._cache.pop(pid, None)
        return len(dead)

    # --- reading /proc -----------------------------------------------------

    def _read(self, pid: int, name: str) -> bytes:
        with open(os.path.join(self.proc_root, str(pid), name), "rb") as f:
            return f.read()

    def _read_optional(self, pid: int, name: str) -> bytes | None:
        """The file's bytes, or None when it cannot be read. A missing file is
        also what an exited process looks like; the caller's final stat re-read
        tells the two apart."""
        try:
            return self._read(pid, name)
        except OSError as e:
            if e.errno in _DENIED:
                self._note_denied(pid, name, e)
            elif e.errno not in _GONE:
                log.debug("identity: /proc/%s/%s unreadable: %s", pid, name, e)
            return None

    def _note_denied(self, pid: int, name: str, error: OSError) -> None:
        self.stats["permission_denied"] += 1
        if not self._logged_denied:
            self._logged_denied = True
            log.debug("identity: cannot read /proc/%s/%s (%s); resolving from what is readable. "
                      "Run the agent as root with CAP_SYS_PTRACE to read every process's environment.",
                      pid, name, error.strerror)

    def _image_key(self, pid: int) -> tuple:
        """(starttime, exe device+inode or comm): equal only for the same
        program image. starttime catches pid reuse; exec keeps starttime, so the
        executable's inode (or comm, when exe is not readable) catches that.
        An exec of the same binary is not noticed; the cache then serves the
        pre-exec identity until the process is forgotten."""
        try:
            text = self._read(pid, "stat").decode(errors="replace")
        except OSError as e:
            if e.errno in _DENIED:
                self._note_denied(pid, "stat", e)
                raise _Hidden from None
            raise _Vanished from None
        # comm may hold spaces and ')', so split at the last ')'.
        comm = text[text.find("(") + 1:text.rfind(")")]
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) < 20 or fields[0] in ("Z", "X"):  # zombie or dead: it has exited
            raise _Vanished
        starttime = fields[19]  # field 22 of proc(5); fields[0] is field 3
        try:
            st = os.stat(os.path.join(self.proc_root, str(pid), "exe"))
            image = (st.st_dev, st.st_ino)
        except OSError:  # kernel threads have no exe; other users' exe is denied
            image = comm
        return (starttime, image)

    def _read_identity(self, pid: int, key: tuple) -> Identity:
        raw_env = self._read_optional(pid, "environ")
        raw_cgroup = self._read_optional(pid, "cgroup")
        # A process that exits mid-way reads as empty or missing files; a pid
        # reused mid-way reads as another process. Both show in a fresh key.
        if self._image_key(pid) != key:
            raise _Vanished
        env = parse_environ(raw_env or b"")
        cgroup_text = (raw_cgroup or b"").decode(errors="replace")
        container, pod = parse_cgroup(cgroup_text)
        paths = [line.split(":", 2)[-1] for line in cgroup_text.splitlines() if line]
        info = self.rules.sources.pod(pod) if self.rules.sources is not None and pod else None
        job, source = self.rules.job(env, self.host)
        visible = tuple(d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip())
        # Indexes only: UUIDs and MIG names need NVML to become an index.
        gpu = int(visible[0]) if visible and visible[0].isdigit() else -1
        return Identity(tenant=self.rules.tenant(env, pod, paths), job=job,
                        namespace=info.namespace if info else "", pod_name=info.name if info else "",
                        container_name=info.container_name(container) if info else "",
                        rank=_first_int(env, RANK_ENV), local_rank=_first_int(env, LOCAL_RANK_ENV),
                        world_size=_first_int(env, WORLD_SIZE_ENV), gpu=gpu, visible_devices=visible,
                        container=container, pod=pod, master_addr=env.get("MASTER_ADDR", ""), source=source)

    def _with_nvml_gpu(self, pid: int, base: Identity) -> Identity:
        if self.nvml_processes is None:
            return base
        try:
            gpu = self.nvml_processes().get(pid)
        # Any NVML failure (lost GPU, driver reload) must not cost the event its identity.
        except Exception as e:  # noqa: BLE001
            if not self._logged_nvml:
                self._logged_nvml = True
                log.debug("identity: NVML process list unavailable (%s); using CUDA_VISIBLE_DEVICES", e)
            return base
        if gpu is None or gpu == base.gpu:
            return base
        return dataclasses.replace(base, gpu=gpu)

"""Where a process's tenant comes from when the workload itself cannot be trusted to say.

Trusted sources, in order:
- the pod's namespace: the cgroup names the pod UID; the kubelet's pod list
  (its read-only `/pods` JSON, from a URL or a file) or the node mapping file
  names the pod's namespace;
- the node mapping file (TOML, written by the operator, read-only to workloads):
    [pods]            "<pod uid>" = "namespace/pod-name"
    [cgroups]         "<glob over the cgroup path>" = "tenant"   e.g. "/system.slice/slurmstepd.scope/job_*" = "hpc"
    [slurm_accounts]  "<account>" = "tenant"
  Slurm accounts are read from SLURM_JOB_ACCOUNT, which slurmd sets; only
  accounts listed in the file map to a tenant, so a made-up account maps to none.

A workload's own environment (tenant_env) is consulted after these, and only
when the operator marked it trusted.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class TenantMapError(ValueError):
    pass


@dataclass(frozen=True)
class PodInfo:
    namespace: str
    name: str
    containers: tuple[tuple[str, str], ...] = ()  # (container id, container name)

    def container_name(self, container_id: str) -> str:
        for cid, name in self.containers:
            if container_id and cid.startswith(container_id):
                return name
        return ""


def parse_kubelet_pods(data: dict) -> dict[str, PodInfo]:
    """{pod uid: PodInfo} from the kubelet's /pods answer (a v1 PodList)."""
    pods = {}
    for item in data.get("items") or []:
        meta = item.get("metadata") or {}
        uid, ns, name = meta.get("uid"), meta.get("namespace"), meta.get("name")
        if not (uid and ns and name):
            continue
        containers = []
        status = item.get("status") or {}
        for cs in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or []):
            cid = str(cs.get("containerID") or "").partition("://")[2]
            if cid and cs.get("name"):
                containers.append((cid, str(cs["name"])))
        pods[str(uid)] = PodInfo(str(ns), str(name), tuple(containers))
    return pods


class TenantSources:
    """Resolves pods, cgroups and Slurm accounts to tenants from the operator's sources."""

    def __init__(self, map_file: str | Path | None = None, kubelet_pods: str | None = None,
                 kubelet_refresh_s: float = 10.0):
        self.pods: dict[str, PodInfo] = {}
        self.cgroups: list[tuple[str, str]] = []
        self.slurm_accounts: dict[str, str] = {}
        self.kubelet_pods = kubelet_pods
        self.kubelet_refresh_s = kubelet_refresh_s
        self._kubelet: dict[str, PodInfo] = {}
        self._kubelet_read_at = float("-inf")
        self._logged_kubelet = False
        if map_file:
            self._load_map(Path(map_file))

    def _load_map(self, path: Path) -> None:
        try:
            data = tomllib.loads(path.read_text())
        except OSError as e:
            raise TenantMapError(f"tenant_map_file {path}: cannot read it ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise TenantMapError(f"tenant_map_file {path} is not valid TOML: {e}") from None
        for uid, value in (data.get("pods") or {}).items():
            ns, sep, name = str(value).partition("/")
            if not sep or not ns:
                raise TenantMapError(f"tenant_map_file {path}: [pods] {uid} = {value!r} must be \"namespace/pod\"")
            self.pods[str(uid)] = PodInfo(ns, name)
        self.cgroups = [(str(k), str(v)) for k, v in (data.get("cgroups") or {}).items()]
        self.slurm_accounts = {str(k): str(v) for k, v in (data.get("slurm_accounts") or {}).items()}

    @property
    def configured(self) -> bool:
        return bool(self.pods or self.cgroups or self.slurm_accounts or self.kubelet_pods)

    def pod(self, uid: str) -> PodInfo | None:
        if not uid:
            return None
        if uid in self.pods:
            return self.pods[uid]
        if self.kubelet_pods:
            if uid not in self._kubelet and time.monotonic() - self._kubelet_read_at >= self.kubelet_refresh_s:
                self._read_kubelet()  # a new pod: read the list again, at most every kubelet_refresh_s
            return self._kubelet.get(uid)
        return None

    def _read_kubelet(self) -> None:
        self._kubelet_read_at = time.monotonic()
        src = self.kubelet_pods
        try:
            if src.startswith(("http://", "https://")):
                with urllib.request.urlopen(src, timeout=2.0) as resp:  # the kubelet's read-only port, on the node
                    data = json.load(resp)
            else:
                data = json.loads(Path(src).read_text())
            self._kubelet = parse_kubelet_pods(data)
        except (OSError, ValueError) as e:
            if not self._logged_kubelet:
                self._logged_kubelet = True
                log.warning("identity: cannot read the kubelet pod list %s (%s); pods fall back to the mapping file",
                            src, e)

    def tenant(self, pod_uid: str, cgroup_paths: list[str], env: dict[str, str]) -> str | None:
        """The tenant from a trusted source, or None when none names one."""
        info = self.pod(pod_uid)
        if info is not None:
            return info.namespace
        for pattern, tenant in self.cgroups:
            if any(fnmatch.fnmatchcase(p, pattern) for p in cgroup_paths):
                return tenant
        account = env.get("SLURM_JOB_ACCOUNT", "")
        if account and account in self.slurm_accounts:
            return self.slurm_accounts[account]
        return None

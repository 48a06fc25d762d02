"""Identity resolution against real processes and the real /proc.

Launcher environments (torchrun, Slurm, MPI) are given to real child processes.
Container and pod cgroups cannot be: moving a process into a fake docker or
kubepods cgroup needs privileges the test machines do not grant. Those tests
(and the pid-reuse one, since a pid cannot be made to recur on demand) read a
fixture tree passed as proc_root, laid out like /proc.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetscope.producers.identity import Identity, IdentityResolver, IdentityRules, parse_cgroup
from support.processes import spawn, wait_until  # noqa: F401 (spawn is a fixture)

HEX = "4f1c2d3e" * 8  # a 64-hex container id




def fake_proc(root, pid: int, *, environ: bytes = b"", cgroup: str = "0::/\n",
              comm: str = "python3", starttime: int = 1000) -> None:
    """A /proc/<pid> with the files the resolver reads (no exe: comm keys the cache)."""
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    # Fields 3..52 of proc(5); field 22 is starttime.
    fields = ["S"] + ["0"] * 18 + [str(starttime)] + ["0"] * 30
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
    (d / "environ").write_bytes(environ)
    (d / "cgroup").write_text(cgroup)


# --- launcher environments, real processes -----------------------------------

TORCHRUN_ENV = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "MASTER_ADDR": "10.0.0.7",
                "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "run-abc", "CUDA_VISIBLE_DEVICES": "2,3"}


def test_torchrun_env_gives_rank_job_and_first_visible_gpu(spawn):
    proc = spawn(TORCHRUN_ENV)
    ident = IdentityResolver().resolve(proc.pid)
    assert ident == Identity(tenant="default", job="run-abc", rank=5, local_rank=1, world_size=16, gpu=2,
                             visible_devices=("2", "3"), container="", pod="", master_addr="10.0.0.7",
                             source="torchelastic")


def test_slurm_env_gives_slurm_job_and_ranks(spawn):
    proc = spawn({"SLURM_JOB_ID": "81234", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"})
    ident = IdentityResolver().resolve(proc.pid)
    assert (ident.job, ident.source, ident.rank, ident.local_rank, ident.world_size) == ("81234", "slurm", 3, 1, 8)
    assert ident.gpu == -1 and ident.visible_devices == ()


def test_mpi_env_gives_mpi_job_and_ranks(spawn):
    proc = spawn({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                  "OMPI_MCA_orte_ess_jobid": "3735879681"})
    ident = IdentityResolver().resolve(proc.pid)
    assert (ident.job, ident.source, ident.rank, ident.local_rank, ident.world_size) == ("3735879681", "mpi", 2, 0, 4)


def test_torchrun_rank_outranks_slurm_when_launched_under_srun(spawn):
    proc = spawn({**TORCHRUN_ENV, "SLURM_JOB_ID": "81234", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    ident = IdentityResolver().resolve(proc.pid)
    assert (ident.job, ident.rank, ident.world_size) == ("run-abc", 5, 16)


def test_static_rendezvous_without_run_id_keys_job_on_master_address(spawn):
    # torchrun's default --rdzv-id is the literal "none", shared by unrelated jobs.
    env = {**TORCHRUN_ENV, "TORCHELASTIC_RUN_ID": "none"}
    ident = IdentityResolver().resolve(spawn(env).pid)
    assert (ident.job, ident.source) == ("10.0.0.7:29500", "rendezvous")


def test_loopback_rendezvous_is_qualified_by_host(spawn):
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    ident = IdentityResolver(host="node-17").resolve(spawn(env).pid)
    assert ident.job == "node-17:29500"


def test_plain_process_has_no_job_and_unknown_rank(spawn):
    ident = IdentityResolver().resolve(spawn({"PATH": "/usr/bin:/bin"}).pid)
    assert ident == Identity(tenant="default", job="", source="none")
    assert (ident.rank, ident.local_rank, ident.world_size, ident.gpu) == (-1, -1, -1, -1)


def test_tenant_env_overrides_default_tenant_where_trusted(spawn):
    trusted = IdentityRules(tenant_env_trusted=True)
    ident = IdentityResolver(rules=trusted).resolve(spawn({**TORCHRUN_ENV, "FLEETSCOPE_TENANT": "vision-team"}).pid)
    assert ident.tenant == "vision-team"
    renamed = IdentityRules(tenant_env="TEAM", default_tenant="shared", tenant_env_trusted=True)
    proc = spawn({"TEAM": "nlp", "FLEETSCOPE_TENANT": "ignored"})
    assert IdentityResolver(rules=renamed).resolve(proc.pid).tenant == "nlp"


def test_fleetscope_job_env_takes_precedence(spawn):
    ident = IdentityResolver().resolve(spawn({**TORCHRUN_ENV, "FLEETSCOPE_JOB": "bert-sweep-3"}).pid)
    assert (ident.job, ident.source) == ("bert-sweep-3", "env:FLEETSCOPE_JOB")


def test_nvml_process_list_overrides_visible_devices_guess(spawn):
    proc = spawn(TORCHRUN_ENV)
    resolver = IdentityResolver(nvml_processes=lambda: {proc.pid: 6})
    assert resolver.resolve(proc.pid).gpu == 6
    assert resolver.resolve(proc.pid).visible_devices == ("2", "3")


def test_nvml_failure_falls_back_to_visible_devices(spawn):
    def broken_nvml():
        raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    proc = spawn(TORCHRUN_ENV)
    assert IdentityResolver(nvml_processes=broken_nvml).resolve(proc.pid).gpu == 2


# --- caching, exec, exit -----------------------------------------------------

def test_second_resolve_is_a_cache_hit(spawn):
    proc = spawn(TORCHRUN_ENV)
    resolver = IdentityResolver()
    first = resolver.resolve(proc.pid)
    assert resolver.resolve(proc.pid) is first
    assert resolver.stats["resolved"] == 1 and resolver.stats["cache_hits"] == 1


def test_exec_into_new_program_invalidates_cache(spawn):
    # Same pid and starttime across exec; the new executable's inode differs.
    script = f"read _; exec env RANK=7 {sys.executable} -c 'import time; time.sleep(30)'"
    proc = spawn({"PATH": os.environ["PATH"], "RANK": "3"}, ["bash", "-c", script], stdin=subprocess.PIPE)
    resolver = IdentityResolver()
    assert resolver.resolve(proc.pid).rank == 3
    assert resolver.resolve(proc.pid).rank == 3 and resolver.stats["cache_hits"] == 1
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    after = wait_until(lambda: (i := resolver.resolve(proc.pid)) and i.rank == 7 and i)
    assert after.rank == 7 and resolver.stats["resolved"] >= 2


def test_process_that_exited_between_calls_resolves_to_none(spawn):
    proc = spawn(TORCHRUN_ENV)
    resolver = IdentityResolver()
    assert resolver.resolve(proc.pid) is not None
    proc.kill()
    proc.wait()  # reaped: /proc/<pid> is gone
    assert resolver.resolve(proc.pid) is None
    assert resolver.stats["vanished"] == 1
    assert resolver.forget_dead() == 0  # the failed resolve already dropped it


def test_process_exiting_mid_resolution_resolves_to_none(spawn):
    proc = spawn(TORCHRUN_ENV)

    class KillsAfterEnviron(IdentityResolver):
        # The real process is killed and reaped between the environ and the
        # cgroup reads, the window a resolver on a busy node must survive.
        def _read(self, pid, name):
            if name == "cgroup" and proc.poll() is None:
                proc.kill()
                proc.wait()
            return super()._read(pid, name)

    resolver = KillsAfterEnviron()
    assert resolver.resolve(proc.pid) is None
    assert resolver.stats == {"resolved": 0, "cache_hits": 0, "vanished": 1, "permission_denied": 0}
    assert resolver._cache == {}


def test_zombie_resolves_to_none(spawn):
    proc = spawn(TORCHRUN_ENV)
    proc.kill()  # not reaped yet: /proc/<pid> still exists, state Z
    stat = Path(f"/proc/{proc.pid}/stat")
    wait_until(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")
    assert IdentityResolver().resolve(proc.pid) is None


def test_forget_dead_drops_exited_pids(spawn):
    alive, dying = spawn(TORCHRUN_ENV), spawn(TORCHRUN_ENV)
    resolver = IdentityResolver()
    resolver.resolve(alive.pid), resolver.resolve(dying.pid)
    dying.kill()
    dying.wait()
    assert resolver.forget_dead() == 1
    assert list(resolver._cache) == [alive.pid]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to run the resolver as another user")
def test_unreadable_environ_still_gives_identity_from_what_is_readable(spawn):
    # Run the resolver as nobody against our root-owned process: environ is denied, cgroup is not.
    # (setpriv rather than Popen(user=): here only it may start an interpreter that lives under /root.)
    target = spawn(TORCHRUN_ENV)
    code = ("import json, dataclasses; from fleetscope.producers.identity import IdentityResolver; r = IdentityResolver(); "
            f"i = r.resolve({target.pid}); print(json.dumps([dataclasses.asdict(i), r.stats]))")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    out = subprocess.run([*as_nobody, sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=30,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    ident, stats = json.loads(out.stdout)
    assert (ident["tenant"], ident["job"], ident["rank"]) == ("default", "", -1)
    assert stats["permission_denied"] >= 1 and stats["resolved"] == 1


# --- fixture /proc trees -----------------------------------------------------

def test_pid_reuse_is_detected_by_starttime(tmp_path):
    fake_proc(tmp_path, 4242, environ=b"RANK=1\0SLURM_JOB_ID=11\0", starttime=1000)
    resolver = IdentityResolver(proc_root=tmp_path)
    assert resolver.resolve(4242).rank == 1
    assert resolver.resolve(4242).rank == 1 and resolver.stats["cache_hits"] == 1
    # Same pid and comm, later start: a different process.
    fake_proc(tmp_path, 4242, environ=b"RANK=2\0SLURM_JOB_ID=12\0", starttime=5000)
    ident = resolver.resolve(4242)
    assert (ident.rank, ident.job) == (2, "12") and resolver.stats["resolved"] == 2


def test_huge_environ_with_undecodable_bytes(tmp_path):
    environ = b"JUNK=" + b"x" * 2_000_000 + b"\0NAME=caf\xe9\0RANK=4\0CUDA_VISIBLE_DEVICES=GPU-5d1f,GPU-77aa\0"
    fake_proc(tmp_path, 7, environ=environ)
    ident = IdentityResolver(proc_root=tmp_path).resolve(7)
    # UUIDs cannot be turned into an index without NVML.
    assert (ident.rank, ident.gpu, ident.visible_devices) == (4, -1, ("GPU-5d1f", "GPU-77aa"))


def test_missing_cgroup_file_on_live_process_is_not_an_exit(tmp_path):
    # Kernels without cgroups have no /proc/<pid>/cgroup; stat still says the process lives.
    fake_proc(tmp_path, 8, environ=b"RANK=0\0")
    (tmp_path / "8" / "cgroup").unlink()
    assert IdentityResolver(proc_root=tmp_path).resolve(8).rank == 0


POD_UID = "0f2b6c1e-9a4d-4e7b-8c3f-5d6a7b8c9d0e"
POD_UID_SYSTEMD = POD_UID.replace("-", "_")  # the systemd cgroup driver's spelling
V1_POD_PATH = f"/kubepods/burstable/pod{POD_UID}/{HEX}"
V2_POD_SLICE = f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_UID_SYSTEMD}.slice"
CGROUPS = {
    "docker cgroup v1": (f"12:pids:/docker/{HEX}\n4:memory:/docker/{HEX}\n1:name=systemd:/docker/{HEX}\n",
                         HEX[:12], ""),
    "docker cgroup v2 systemd": (f"0::/system.slice/docker-{HEX}.scope\n", HEX[:12], ""),
    "containerd plain": ("0::/containerd/redis-cache\n", "redis-cache", ""),
    "containerd hex id": (f"0::/containerd/{HEX}\n", HEX[:12], ""),
    "kubepods v1 cgroupfs": (f"11:memory:{V1_POD_PATH}\n1:name=systemd:{V1_POD_PATH}\n", HEX[:12], POD_UID),
    "kubepods v2 systemd": (f"0::{V2_POD_SLICE}/cri-containerd-{HEX}.scope\n", HEX[:12], POD_UID),
    "kubepods v2 cri-o": (f"0::/kubepods.slice/kubepods-pod{POD_UID_SYSTEMD}.slice/crio-{HEX}.scope\n",
                          HEX[:12], POD_UID),
    "host session": ("0::/user.slice/user-1000.slice/session-3.scope\n", "", ""),
}


@pytest.mark.parametrize("cgroup, container, pod", CGROUPS.values(), ids=CGROUPS.keys())
def test_cgroup_gives_container_and_pod(tmp_path, cgroup, container, pod):
    fake_proc(tmp_path, 100, environ=b"RANK=0\0", cgroup=cgroup)
    ident = IdentityResolver(proc_root=tmp_path).resolve(100)
    assert (ident.container, ident.pod) == (container, pod)


def test_nested_docker_reports_innermost_container():
    inner = "ab" * 32
    assert parse_cgroup(f"0::/docker/{HEX}/docker/{inner}\n") == (inner[:12], "")


def test_pod_mapping_decides_tenant_over_environment(tmp_path):
    cgroup = f"0::/kubepods.slice/kubepods-pod{POD_UID_SYSTEMD}.slice/cri-containerd-{HEX}.scope\n"
    fake_proc(tmp_path, 200, environ=b"FLEETSCOPE_TENANT=claimed\0", cgroup=cgroup)
    fake_proc(tmp_path, 201, environ=b"FLEETSCOPE_TENANT=claimed\0", cgroup="0::/\n")
    rules = IdentityRules(tenant_by_pod={POD_UID: "team-ml"}.get, tenant_env_trusted=True)
    resolver = IdentityResolver(rules=rules, proc_root=tmp_path)
    assert resolver.resolve(200).tenant == "team-ml"
    assert resolver.resolve(201).tenant == "claimed"  # no pod: the environment decides
    off = IdentityRules(tenant_by_pod={POD_UID: "team-ml"}.get, tenant_from_namespace=False, tenant_env_trusted=True)
    assert IdentityResolver(rules=off, proc_root=tmp_path).resolve(200).tenant == "claimed"

"""Tenants that cannot be faked, and identity values that are safe to publish.

Processes are fake /proc trees holding real cgroup layouts, as each runtime
writes them (a stand-in for Kubernetes, CRI-O, Docker and Slurm, which this
machine lacks). The kubelet's pod list is a file in the kubelet's own JSON shape.
"""
import json
from types import SimpleNamespace

import pytest

from fleetscope.config import ConfigError, load
from prometheus_client import generate_latest

from fleetscope.producers.agent import Agent, identity_rules
from fleetscope.producers.agent_metrics import metrics_registry
from fleetscope.producers.publisher import PublisherStats
from fleetscope.producers.identity import IdentityResolver, IdentityRules
from fleetscope.producers.tenant_sources import TenantMapError, TenantSources

CID = "9d3c5e1f" * 8
POD = "1f2e3d4c-5b6a-4789-9abc-def012345678"
POD_SYSTEMD = POD.replace("-", "_")

CGROUPS = {  # runtime -> /proc/<pid>/cgroup, cgroup v2
    "containerd": f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_SYSTEMD}.slice/"
                  f"cri-containerd-{CID}.scope\n",
    "containerd-cgroupfs": f"0::/kubepods/burstable/pod{POD}/{CID}\n",
    "crio": f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_SYSTEMD}.slice/crio-{CID}.scope\n",
    "docker": f"0::/system.slice/docker-{CID}.scope\n",
    "slurm": "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n",
}


def fake_proc(root, pid, *, environ=b"", cgroup="0::/\n"):
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    fields = ["S"] + ["0"] * 18 + ["1000"] + ["0"] * 30
    (d / "stat").write_text(f"{pid} (python3) {' '.join(fields)}\n")
    (d / "environ").write_bytes(environ)
    (d / "cgroup").write_text(cgroup)


def kubelet_pods_file(path):
    path.write_text(json.dumps({"kind": "PodList", "apiVersion": "v1", "items": [{
        "metadata": {"name": "trainer-0", "namespace": "team-vision", "uid": POD},
        "status": {"containerStatuses": [{"name": "trainer", "containerID": f"containerd://{CID}"}]}}]}))
    return path


@pytest.mark.parametrize("runtime", ["containerd", "containerd-cgroupfs", "crio"])
def test_the_pods_namespace_is_the_tenant_whatever_the_workload_claims(tmp_path, runtime):
    proc = tmp_path / "proc"
    fake_proc(proc, 300, environ=b"FLEETSCOPE_TENANT=team-other\0FLEETSCOPE_JOB=j1\0", cgroup=CGROUPS[runtime])
    sources = TenantSources(kubelet_pods=str(kubelet_pods_file(tmp_path / "pods.json")))
    # the environment is trusted here, so the namespace wins on precedence, not because env is ignored
    ident = IdentityResolver(IdentityRules(sources=sources, tenant_env_trusted=True), proc_root=proc).resolve(300)
    assert ident.tenant == "team-vision"
    assert (ident.namespace, ident.pod_name, ident.pod) == ("team-vision", "trainer-0", POD)
    assert ident.container == CID[:12] and ident.container_name == "trainer"


def test_a_node_mapping_file_maps_pods_cgroups_and_slurm_accounts(tmp_path):
    mapping = tmp_path / "tenants.toml"
    mapping.write_text(f'[pods]\n"{POD}" = "team-nlp/llm-0"\n'
                       '[cgroups]\n"/system.slice/docker-*.scope" = "batch"\n'
                       '"/system.slice/slurmstepd.scope/job_4242/*" = "hpc-physics"\n'
                       '[slurm_accounts]\nchem = "hpc-chem"\n')
    proc = tmp_path / "proc"
    fake_proc(proc, 1, cgroup=CGROUPS["crio"], environ=b"FLEETSCOPE_TENANT=x\0")
    fake_proc(proc, 2, cgroup=CGROUPS["docker"], environ=b"FLEETSCOPE_TENANT=x\0")
    fake_proc(proc, 3, cgroup=CGROUPS["slurm"], environ=b"SLURM_JOB_ACCOUNT=chem\0")
    fake_proc(proc, 4, cgroup="0::/system.slice/slurmstepd.scope/job_7/step_0\n", environ=b"SLURM_JOB_ACCOUNT=chem\0")
    fake_proc(proc, 5, cgroup="0::/system.slice/slurmstepd.scope/job_8/step_0\n", environ=b"SLURM_JOB_ACCOUNT=made-up\0")
    rules = IdentityRules(sources=TenantSources(map_file=mapping), tenant_env_trusted=False, default_tenant="unmapped")
    resolver = IdentityResolver(rules, proc_root=proc)
    assert resolver.resolve(1).tenant == "team-nlp" and resolver.resolve(1).namespace == "team-nlp"
    assert resolver.resolve(2).tenant == "batch"
    assert resolver.resolve(3).tenant == "hpc-physics"  # the cgroup path outranks the account
    assert resolver.resolve(4).tenant == "hpc-chem"
    assert resolver.resolve(5).tenant == "unmapped"  # an account the operator did not list maps to nothing


def test_the_workloads_environment_names_the_tenant_only_when_trusted(tmp_path):
    proc = tmp_path / "proc"
    fake_proc(proc, 10, environ=b"FLEETSCOPE_TENANT=team-a\0")
    # least privilege: by default a workload's own environment does not choose its tenant
    assert IdentityResolver(IdentityRules(), proc_root=proc).resolve(10).tenant == "default"
    assert load(env={}).tenant_env_trusted is False
    assert identity_rules(load(env={})).tenant_env_trusted is False
    trusted = IdentityRules(tenant_env_trusted=True)
    assert IdentityResolver(trusted, proc_root=proc).resolve(10).tenant == "team-a"
    cfg = load(env={"FLEETSCOPE_TENANT_ENV_TRUSTED": "true"})
    assert cfg.tenant_env_trusted is True and identity_rules(cfg).tenant_env_trusted is True


def test_no_process_can_claim_the_reserved_node_tenant(tmp_path):
    proc = tmp_path / "proc"
    fake_proc(proc, 20, environ=b"FLEETSCOPE_TENANT=_node\0FLEETSCOPE_JOB=j\0")
    rules = IdentityRules(tenant_env_trusted=True)  # trusted, so the claim is read and refused for its name
    assert IdentityResolver(rules, proc_root=proc).resolve(20).tenant == "default"
    assert rules.rejected["tenant"] == 1


@pytest.mark.parametrize("bad", ["a/b", "x" * 200, "has space", "evil\nline", "_hidden", "../../etc"])
def test_identity_values_that_are_not_name_shaped_are_never_published(tmp_path, bad):
    proc = tmp_path / "proc"
    fake_proc(proc, 30, environ=f"FLEETSCOPE_TENANT={bad}\0FLEETSCOPE_JOB={bad}\0SLURM_JOB_ID=777\0".encode())
    ident = IdentityResolver(IdentityRules(tenant_env_trusted=True), proc_root=proc).resolve(30)
    assert ident.tenant == "default"
    assert (ident.job, ident.source) == ("777", "slurm")  # the next configured variable decides


def test_the_agent_counts_the_identity_values_it_refused_in_its_health_event_and_metrics(tmp_path):
    proc = tmp_path / "proc"
    fake_proc(proc, 30, environ=b"FLEETSCOPE_JOB=../../etc\0SLURM_JOB_ID=777\0")
    cfg = load(env={})
    # the publisher's counters only: no message is sent here (the agent's Kafka path has its own tests)
    agent = Agent(cfg, SimpleNamespace(stats=PublisherStats()), [])
    rules = identity_rules(cfg)
    agent.identity_rules.append(rules)
    IdentityResolver(rules, proc_root=proc).resolve(30)
    assert agent.stats()["identity_rejected_job"] == 1 and agent.stats()["identity_rejected_tenant"] == 0
    text = generate_latest(metrics_registry(agent)).decode()
    assert f'fleetscope_agent_identity_rejected_total{{host="{cfg.host}",kind="job"}} 1.0' in text, text


@pytest.mark.parametrize("var", ["AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "DB_PASSWORD", "API_KEY"])
def test_identity_variables_that_look_like_secrets_are_refused_at_start(var):
    with pytest.raises(ConfigError, match="look like secrets"):
        load(env={"FLEETSCOPE_JOB_ENV": var})
    with pytest.raises(ConfigError, match="look like secrets"):
        load(env={"FLEETSCOPE_TENANT_ENV": var})
    with pytest.raises(ValueError, match="looks like a secret"):
        IdentityRules(job_env=(var,))


def test_a_broken_mapping_file_is_one_clear_error(tmp_path):
    bad = tmp_path / "t.toml"
    bad.write_text('[pods]\n"uid" = "no-slash"\n')
    with pytest.raises(TenantMapError, match="must be \"namespace/pod\""):
        TenantSources(map_file=bad)
    with pytest.raises(TenantMapError, match="cannot read"):
        TenantSources(map_file=tmp_path / "missing.toml")

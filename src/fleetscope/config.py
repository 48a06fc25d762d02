"""Configuration: defaults, then a TOML file, then FLEETSCOPE_* environment variables.

Secrets (ClickHouse passwords) never live here: they come from the
environment or a file, read by the store backend.
"""
from __future__ import annotations

import os
import re
import socket
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from fleetscope.schema import TRACED_SOURCES


class ConfigError(ValueError):
    pass


# The tracers `trace` may name, each after the source it publishes: the kernel tracer (tracepoints, never
# duty-cycled, so no sample_frac) and the schema's duty-cycled traced sources. Their classes are in
# fleetscope.producers.tracers.registry, whose test checks that it agrees with this list.
TRACE_FAMILIES = ("kernel", *TRACED_SOURCES)


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "fleetscope"


@dataclass(frozen=True)
class Config:
    # Kafka: None means "start the embedded broker".
    kafka: str | None = None
    embedded_broker_port: int = 0  # 0: pick a free loopback port
    topic_prefix: str = "fleetscope"
    partitions: int = 4
    # Topic topology: per-topic partition counts ("features=8", "raw.nvml=12") over `partitions`; the
    # replication factor -1 takes the broker's default.replication.factor (a real cluster's, not 1).
    topic_partitions: tuple[str, ...] = ()
    topic_replication: int = -1
    create_topics: bool = True  # False on clusters where an admin manages topics (`--no-create-topics`)
    # Kafka client security, the librdkafka names ([kafka_security] in the TOML file, FLEETSCOPE_KAFKA_* in the
    # environment). The SASL password is never here: FLEETSCOPE_KAFKA_SASL_PASSWORD or the file below.
    kafka_security_protocol: str = "PLAINTEXT"
    kafka_sasl_mechanism: str | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password_file: str | None = None
    kafka_ssl_ca_location: str | None = None
    kafka_ssl_certificate_location: str | None = None
    kafka_ssl_key_location: str | None = None
    kafka_connect_timeout_s: float = 5.0  # how long a command waits for Kafka at start before one clear error line
    # How long a stream worker's or sink's output may wait for Kafka's acknowledgement (librdkafka's
    # message.timeout.ms) before the process stops non-zero for its supervisor to restart it.
    kafka_delivery_timeout_s: float = 300.0
    # Store: None means embedded chDB under data_dir.
    clickhouse_url: str | None = None
    database: str = "fleetscope"
    ttl_days: int = 7
    data_dir: Path = field(default_factory=default_data_dir)
    # Streams
    window_s: float = 1.0
    allowed_lateness_s: float = 1.0
    idle_close_s: float = 5.0  # wall-clock flush of a key that stopped sending
    consumer_group: str = "fleetscope-streams"
    # Model: a job's ranks are scored together once all have closed a window,
    # or after step_hold_s; no flags during the first warmup_windows windows.
    step_hold_s: float = 3.0
    warmup_windows: int = 30
    detect_rule: str = "gmm or peer"  # which detectors decide: gmm, peer, hst, mahalanobis with and/or
    # A flagged rank-window is an anomaly once its rank is flagged in K of its last N windows ("1 of 1": every
    # flag); loud failures alert at once (streams/model/confirmation.py)
    alert_confirm: str = "3 of 5"
    model_checkpoint_s: float = 30.0
    # Delivery: events more than this far ahead of the worker's clock go to the DLQ (as do those
    # older than ttl_days); a store outage is logged once per store_error_log_s with a count;
    # keys and job models idle for idle_evict_s are checkpointed and dropped from memory.
    max_future_skew_s: float = 300.0
    store_error_log_s: float = 30.0
    idle_evict_s: float = 900.0
    # A sink's poll stops taking records once they hold this many rows (their fs-count headers), so one
    # insert stays a few hundred MB however large the producers' batches (5,000 records of 2,000 events
    # made one 10M-row insert and a 2.95 GB sink). A single larger record still goes, alone.
    sink_max_rows_per_insert: int = 500_000
    # /metrics (Prometheus text format) of the agent and the worker: loopback unless a deployment names an
    # address; port -1 turns it off, 0 takes any free port. Result series of a job idle this long are removed.
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 9464
    sink_metrics_port: int = 9465  # `fleetscope sink`'s /metrics, on metrics_address (it often shares a node)
    metrics_job_expire_s: float = 600.0
    # `fleetscope alert`: where incidents go (either or both), per-tenant routing labels ("tenant:label=value")
    # and webhooks ("tenant=url"), when an incident without new culprit windows resolves, and how often a firing
    # alert is re-posted to Alertmanager (it expires alerts that are not).
    alert_alertmanager_url: str | None = None
    alert_webhook_url: str | None = None
    alert_tenant_labels: tuple[str, ...] = ()
    alert_tenant_webhooks: tuple[str, ...] = ()
    alert_resolve_s: float = 300.0
    alert_resend_s: float = 60.0
    # Where `fleetscope alert` keeps its open incidents across restarts; None: <data_dir>/alert-incidents.<group>.json
    alert_state_file: Path | None = None
    # Agent
    host: str = field(default_factory=socket.gethostname)
    sample_interval_s: float = 1.0
    # What the agent samples, by source name (producers/sources.py): host, nvml, xid, proc, trace. None: every
    # default-enabled one. nvml, proc_sampling and trace below still switch their sources off.
    sources: tuple[str, ...] | None = None
    collectors: tuple[str, ...] | None = None  # None: every default-enabled collector
    spool_max_batches: int = 10_000  # batches held until Kafka acknowledges them (in flight and spooled together)
    spool_max_bytes: int = 256 * 1024 * 1024  # and their bytes in memory; past either bound the oldest is dropped, counted
    # Optional on-disk spool: every unacknowledged batch is also a file here, so an agent restart
    # during a Kafka outage loses nothing. None: memory only.
    spool_dir: Path | None = None
    spool_dir_max_bytes: int = 1024 * 1024 * 1024
    kafka_message_max_bytes: int = 1_000_000  # the broker's message.max.bytes: larger batches are split to fit
    delivery_max_retries: int = 5  # a batch the broker refuses for good (not an outage) is dropped after this many tries
    stop_flush_timeout_s: float = 10.0  # on SIGTERM/SIGINT the agent flushes what it holds for at most this long
    nvml: bool = True  # sample GPUs; without an NVML library this reports one status event
    nvml_library: str | None = None  # a specific libnvidia-ml path; None: the system's
    # Per-process /proc sampling (CPU, faults, context switches, I/O, RSS) of every rank process; no root needed.
    proc_sampling: bool = True
    proc_interval_s: float = 1.0  # per-process reads at most this often, whatever the tick (they cost ~0.3 ms per process)
    # Identity rules: which environment variable names a process's tenant, the
    # tenant when none does, and the variables that name its job, in precedence order.
    tenant_env: str = "FLEETSCOPE_TENANT"
    # Whether a workload's own environment may name its tenant. Trusted sources (the pod's namespace,
    # tenant_map_file) always come first. Off by default (least privilege): a workload could claim any tenant;
    # turn it on only where every workload on the node is the operator's own.
    tenant_env_trusted: bool = False
    # Node-local tenant mapping (TOML): [pods] uid = "namespace/pod", [cgroups] "glob" = "tenant",
    # [slurm_accounts] account = "tenant". None: no mapping file.
    tenant_map_file: Path | None = None
    # The kubelet's pod list JSON (GET /pods of its read-only port), as a URL or a file; resolves a cgroup's
    # pod UID to its namespace, which becomes the tenant. None: not on Kubernetes.
    kubelet_pods: str | None = None
    default_tenant: str = "default"
    job_env: tuple[str, ...] = ("FLEETSCOPE_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                                "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE")
    # eBPF tracing. `trace` names the probe families to load (empty: no tracing).
    # Targets: explicit pids, a regex over process name/command line, and, with
    # trace_auto, every process that maps libcudart, libcuda, libnccl or libtorch.
    trace: tuple[str, ...] = TRACE_FAMILIES
    trace_auto: bool = True
    trace_pids: tuple[str, ...] = ()
    trace_name: str | None = None
    trace_poll_s: float = 1.0  # how often /proc is scanned for new and ended targets
    # Overhead governor: expensive probe families (kernel launches, Python
    # functions, torch ops) are duty-cycled so that probe hits cost at most
    # trace_budget of the traced processes' CPU time; the always-on families' of their wall time while they
    # mostly wait (on a GPU, on peers) and the host has idle CPU (producers/tracers/governor.py).
    trace_budget: float = 0.01
    # Attaching and detaching probes costs the traced process too (measured: toggling torch's op
    # probes every second cost far more than their hits), so periods are long: 1–2% on of 30 s.
    trace_duty_period_s: float = 30.0
    trace_hit_cost_ns: float | None = None  # None: measured at start (calibration)
    # Probe families never attached, as "<tracer>.<family>" (empty: every family the governor allows). Python's
    # function probes are off by default: their cost is not in their hits. Measured on the dev scenario
    # healthy_rank_differs (3 gloo ranks on 2 cores, one with 2 threads): with them duty-cycled at 4-8%, the
    # busy rank fell from 25 to 6-10 steps a second for 5-13 s at a time, 33 windows flagged; without the
    # python tracer, 24-27 throughout and none. Python's GC probes and the stack sampler stay on.
    trace_off: tuple[str, ...] = ("python.functions",)
    trace_python_prefixes: tuple[str, ...] = ()  # module/file prefixes to trace; empty: all
    # Capture around anomalies: the agent keeps this many seconds of per-call records (the CUDA, NCCL, torch and
    # Python tracers in detail mode) in memory, at most trace_capture_max_records (the oldest dropped past it,
    # counted), and on an anomaly of a rank it hosts publishes that rank's window (± one window) to <prefix>.traces.
    # 0: off.
    trace_capture_s: float = 0.0
    trace_capture_max_records: int = 100_000
    # With trace_capture_s > 0: True, the tracers send per-call records all the time and anomalies are captured;
    # False, they send them only during live capture requests' spans (the per-call cost is paid only then) and
    # anomalies are not captured. The ring (trace_capture_s) still holds what requests are cut from.
    trace_capture_anomalies: bool = True
    # Live capture requests (`fleetscope trace --live`, <prefix>.control): the longest span one may ask for, in
    # seconds. The command refuses longer ones, and an agent counts them invalid (capture_requests_invalid).
    trace_request_max_s: float = 300.0

    def topic(self, name: str) -> str:
        return f"{self.topic_prefix}.{name}"

    def raw_topic(self, source: str) -> str:
        return f"{self.topic_prefix}.raw.{source}"

    def validate(self) -> "Config":
        if not 0.1 <= self.sample_interval_s <= 10:
            raise ConfigError(f"sample_interval_s={self.sample_interval_s}: must lie in [0.1, 10] seconds")
        if self.window_s <= 0 or self.allowed_lateness_s < 0:
            raise ConfigError("window_s must be > 0 and allowed_lateness_s >= 0")
        if self.partitions < 1:
            raise ConfigError("partitions must be >= 1")
        if self.topic_replication == 0 or self.topic_replication < -1:
            raise ConfigError(f"topic_replication={self.topic_replication}: must be -1 (the broker's default) or >= 1")
        if not self.topic_prefix or any(c in self.topic_prefix for c in "/ \\"):
            raise ConfigError(f"topic_prefix {self.topic_prefix!r} must be non-empty without '/', spaces")
        unknown = set(self.trace) - set(TRACE_FAMILIES)
        if unknown:
            raise ConfigError(f"trace={list(self.trace)}: unknown {sorted(unknown)}; known: {list(TRACE_FAMILIES)}")
        for item in self.trace_off:
            tracer, _, family = item.partition(".")
            if not tracer or not family:
                raise ConfigError(f"trace_off: {item!r} is not <tracer>.<family> (e.g. python.functions)")
            if tracer not in TRACE_FAMILIES:   # its families are checked when the tracer loads (tracers/manager.py)
                raise ConfigError(f"trace_off: {item!r} names no tracer; known: {list(TRACE_FAMILIES)}")
        if not 0 < self.trace_budget <= 0.5:
            raise ConfigError(f"trace_budget={self.trace_budget}: must lie in (0, 0.5] (a fraction of CPU time)")
        if not 0.1 <= self.proc_interval_s <= 60:
            raise ConfigError(f"proc_interval_s={self.proc_interval_s}: must lie in [0.1, 60] seconds")
        if self.trace_duty_period_s < 0.2 or self.trace_poll_s <= 0:
            raise ConfigError("trace_duty_period_s must be >= 0.2 s and trace_poll_s > 0")
        if self.trace_capture_s < 0 or self.trace_capture_max_records < 1:
            raise ConfigError("trace_capture_s must be >= 0 (0: off) and trace_capture_max_records >= 1")
        if self.trace_request_max_s <= 0:
            raise ConfigError(f"trace_request_max_s={self.trace_request_max_s}: must be > 0 seconds")
        for name in ("metrics_port", "sink_metrics_port"):
            if not -1 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name}={getattr(self, name)}: must be -1 (off), 0 (any free port) or a TCP port")
        if self.sink_max_rows_per_insert < 1:
            raise ConfigError(f"sink_max_rows_per_insert={self.sink_max_rows_per_insert}: must be >= 1")
        if self.alert_resolve_s <= 0 or self.alert_resend_s <= 0 or self.metrics_job_expire_s <= 0:
            raise ConfigError("alert_resolve_s, alert_resend_s and metrics_job_expire_s must be > 0")
        if self.spool_max_batches < 1 or self.spool_max_bytes < 1 or self.spool_dir_max_bytes < 1:
            raise ConfigError("spool_max_batches, spool_max_bytes and spool_dir_max_bytes must be >= 1")
        if not 1.0 <= self.kafka_delivery_timeout_s <= 86_400:
            raise ConfigError(f"kafka_delivery_timeout_s={self.kafka_delivery_timeout_s}: must be 1..86400 seconds")
        if self.kafka_message_max_bytes < 1000 or self.delivery_max_retries < 0 or self.stop_flush_timeout_s < 0:
            raise ConfigError("kafka_message_max_bytes must be >= 1000, delivery_max_retries and stop_flush_timeout_s >= 0")
        # A job or tenant name is published to every reader of the topics: never from a secret.
        for setting, names in (("job_env", self.job_env), ("tenant_env", (self.tenant_env,))):
            secret = [n for n in names if n and SECRET_NAME.search(n)]
            if secret:
                raise ConfigError(f"{setting} names {secret}, which look like secrets (SECRET, TOKEN, PASSWORD, KEY): "
                                  f"their values would be published as identity; name other variables")
        try:
            [int(p) for p in self.trace_pids]
        except ValueError:
            raise ConfigError(f"trace_pids={list(self.trace_pids)}: must be process ids") from None
        return self

# Variable names whose values must never become a published job or tenant name.
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|KEY|CREDENTIAL", re.IGNORECASE)

_ENV = {  # env var -> field
    "FLEETSCOPE_KAFKA": "kafka", "FLEETSCOPE_TOPIC_PREFIX": "topic_prefix",
    "FLEETSCOPE_PARTITIONS": "partitions", "FLEETSCOPE_CLICKHOUSE_URL": "clickhouse_url",
    "FLEETSCOPE_DATABASE": "database", "FLEETSCOPE_TTL_DAYS": "ttl_days",
    "FLEETSCOPE_DATA_DIR": "data_dir", "FLEETSCOPE_WINDOW_S": "window_s",
    "FLEETSCOPE_ALLOWED_LATENESS_S": "allowed_lateness_s", "FLEETSCOPE_IDLE_CLOSE_S": "idle_close_s", "FLEETSCOPE_HOST": "host",
    "FLEETSCOPE_SAMPLE_INTERVAL_S": "sample_interval_s", "FLEETSCOPE_COLLECTORS": "collectors",
    "FLEETSCOPE_SOURCES": "sources",
    "FLEETSCOPE_CONSUMER_GROUP": "consumer_group", "FLEETSCOPE_NVML": "nvml",
    "FLEETSCOPE_NVML_LIBRARY": "nvml_library", "FLEETSCOPE_TENANT_ENV": "tenant_env",
    "FLEETSCOPE_PROC_SAMPLING": "proc_sampling", "FLEETSCOPE_PROC_INTERVAL_S": "proc_interval_s",
    "FLEETSCOPE_DEFAULT_TENANT": "default_tenant", "FLEETSCOPE_JOB_ENV": "job_env",
    "FLEETSCOPE_STEP_HOLD_S": "step_hold_s", "FLEETSCOPE_WARMUP_WINDOWS": "warmup_windows",
    "FLEETSCOPE_DETECT_RULE": "detect_rule", "FLEETSCOPE_ALERT_CONFIRM": "alert_confirm",
    "FLEETSCOPE_MODEL_CHECKPOINT_S": "model_checkpoint_s",
    "FLEETSCOPE_MAX_FUTURE_SKEW_S": "max_future_skew_s", "FLEETSCOPE_STORE_ERROR_LOG_S": "store_error_log_s",
    "FLEETSCOPE_IDLE_EVICT_S": "idle_evict_s", "FLEETSCOPE_SINK_MAX_ROWS_PER_INSERT": "sink_max_rows_per_insert",
    **{f"FLEETSCOPE_{name.upper()}": name for name in (
        "metrics_address", "metrics_port", "sink_metrics_port", "metrics_job_expire_s", "alert_alertmanager_url",
        "alert_webhook_url",
        "alert_tenant_labels", "alert_tenant_webhooks", "alert_resolve_s", "alert_resend_s", "alert_state_file")},
    "FLEETSCOPE_TRACE": "trace", "FLEETSCOPE_TRACE_AUTO": "trace_auto", "FLEETSCOPE_TRACE_PIDS": "trace_pids",
    "FLEETSCOPE_TRACE_NAME": "trace_name", "FLEETSCOPE_TRACE_POLL_S": "trace_poll_s",
    "FLEETSCOPE_TRACE_BUDGET": "trace_budget", "FLEETSCOPE_TRACE_DUTY_PERIOD_S": "trace_duty_period_s",
    "FLEETSCOPE_TRACE_HIT_COST_NS": "trace_hit_cost_ns", "FLEETSCOPE_TRACE_OFF": "trace_off",
    "FLEETSCOPE_TRACE_PYTHON_PREFIXES": "trace_python_prefixes",
    "FLEETSCOPE_TRACE_CAPTURE_S": "trace_capture_s", "FLEETSCOPE_TRACE_CAPTURE_MAX_RECORDS": "trace_capture_max_records",
    "FLEETSCOPE_TRACE_REQUEST_MAX_S": "trace_request_max_s", "FLEETSCOPE_TRACE_CAPTURE_ANOMALIES": "trace_capture_anomalies",
    "FLEETSCOPE_SPOOL_MAX_BATCHES": "spool_max_batches", "FLEETSCOPE_SPOOL_MAX_BYTES": "spool_max_bytes",
    "FLEETSCOPE_SPOOL_DIR": "spool_dir", "FLEETSCOPE_SPOOL_DIR_MAX_BYTES": "spool_dir_max_bytes",
    "FLEETSCOPE_KAFKA_MESSAGE_MAX_BYTES": "kafka_message_max_bytes",
    "FLEETSCOPE_DELIVERY_MAX_RETRIES": "delivery_max_retries", "FLEETSCOPE_STOP_FLUSH_TIMEOUT_S": "stop_flush_timeout_s",
    "FLEETSCOPE_TENANT_ENV_TRUSTED": "tenant_env_trusted", "FLEETSCOPE_TENANT_MAP_FILE": "tenant_map_file",
    "FLEETSCOPE_KUBELET_PODS": "kubelet_pods",
    "FLEETSCOPE_TOPIC_PARTITIONS": "topic_partitions", "FLEETSCOPE_TOPIC_REPLICATION": "topic_replication",
    "FLEETSCOPE_CREATE_TOPICS": "create_topics", "FLEETSCOPE_KAFKA_CONNECT_TIMEOUT_S": "kafka_connect_timeout_s",
    "FLEETSCOPE_KAFKA_DELIVERY_TIMEOUT_S": "kafka_delivery_timeout_s",
    **{f"FLEETSCOPE_{name.upper()}": name for name in (
        "kafka_security_protocol", "kafka_sasl_mechanism", "kafka_sasl_username", "kafka_sasl_password_file",
        "kafka_ssl_ca_location", "kafka_ssl_certificate_location", "kafka_ssl_key_location")},
}
# Every environment variable that sets a setting. A launcher handing its children one config file drops these
# from their environment, where they would override the file (secrets such as the SASL password stay).
SETTING_ENV_VARS = frozenset(_ENV)
# TOML tables whose keys are settings under a prefix: [kafka_security] sasl_username = "x" -> kafka_sasl_username
_SECTIONS = {"kafka_security": "kafka_"}


def _coerce(name: str, raw):
    kinds = {f.name: f.type for f in fields(Config)}
    kind = kinds.get(name)
    if kind is None:
        raise ConfigError(f"unknown setting {name!r}; known: {sorted(kinds)}")
    try:
        if raw is None or raw == "":
            return None if "None" in str(kind) else raw
        if str(kind) == "bool":
            if isinstance(raw, bool):
                return raw
            if str(raw).strip().lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        if "int" in str(kind) and "tuple" not in str(kind):
            return int(raw)
        if "float" in str(kind):
            return float(raw)
        if "Path" in str(kind):
            return Path(os.path.expanduser(str(raw)))
        if "tuple" in str(kind):
            if isinstance(raw, dict):  # a TOML table such as topic_partitions = {features = 8}
                raw = [f"{k}={v}" for k, v in raw.items()]
            items = raw.split(",") if isinstance(raw, str) else list(raw)
            return tuple(i.strip() for i in items if i.strip())
        return str(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"setting {name}={raw!r}: {exc}") from None


def load(path: str | os.PathLike | None = None, env: dict | None = None, **overrides) -> Config:
    """Defaults < file (FLEETSCOPE_CONFIG or `path`) < environment < overrides."""
    env = os.environ if env is None else env
    values: dict = {}
    path = path or env.get("FLEETSCOPE_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        for section, prefix in _SECTIONS.items():
            if isinstance(data.get(section), dict):
                data.update({prefix + k: v for k, v in data.pop(section).items()})
        values.update({k: _coerce(k, v) for k, v in data.items()})
    for var, name in _ENV.items():
        if var in env:
            values[name] = _coerce(name, env[var])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return replace(Config(), **values).validate()

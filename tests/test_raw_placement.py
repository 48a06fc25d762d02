"""Pod, namespace and container of a raw event: resolved by the agent, carried on the wire, columns in the store.

Kubernetes and the container runtime are stand-ins (tests/support/fake_proc.py: a fake /proc holding the cgroup
path containerd really writes, and the kubelet's pod list as a file in its own JSON shape); the resolver, the
wire codec, the worker's admission and the store (chDB, migrated) are the real ones.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from fleetscope.producers.identity import IdentityResolver, IdentityRules
from fleetscope.producers.tenant_sources import TenantSources
from fleetscope.schema import PLACEMENT_COLUMNS, validate
from fleetscope.streams.admission import AdmissionError, check_strings
from fleetscope.streams.sinks import RawSink
from fleetscope.wire import Batch, StrColumn, WireError, decode, encode
from support.fake_proc import CID, CONTAINERD_POD_CGROUP, POD, fake_proc, kubelet_pods_file

PID = 4100


def resolved(tmp_path, kubelet: bool):
    proc = tmp_path / "proc"
    fake_proc(proc, PID, environ=b"FLEETSCOPE_JOB=llm\0RANK=1\0", cgroup=CONTAINERD_POD_CGROUP)
    sources = TenantSources(kubelet_pods=str(kubelet_pods_file(tmp_path / "pods.json"))) if kubelet else None
    return IdentityResolver(IdentityRules(sources=sources), proc_root=proc).resolve(PID)


def test_a_pod_process_has_its_pod_namespace_and_container_names_where_the_kubelet_knows_them(tmp_path):
    assert resolved(tmp_path, kubelet=True).placement() == ("trainer-0", "team-vision", "trainer")


def test_without_the_kubelet_the_cgroup_still_names_the_pod_uid_and_container_id(tmp_path):
    assert resolved(tmp_path, kubelet=False).placement() == (POD, "", CID[:12])


def placed_batch(ident, ts_ns: int, n: int = 3) -> Batch:
    pod, namespace, container = ident.placement()
    cols = {"ts_ns": np.full(n, ts_ns, "<i8"), "tenant": StrColumn.constant(ident.tenant, n),
            "job": StrColumn.constant(ident.job, n), "rank": np.full(n, ident.rank, "<i4"),
            "pid": np.full(n, PID, "<i4"), "gpu": np.full(n, -1, "<i2"),
            "pod": StrColumn.constant(pod, n), "namespace": StrColumn.constant(namespace, n),
            "container": StrColumn.constant(container, n),
            "metric": StrColumn.of([f"proc.m{i}" for i in range(n)]), "device": StrColumn.constant(f"pid{PID}", n),
            "value": np.arange(n, dtype="<f8"), "interval_ns": np.full(n, 10**9, "<i8")}
    return Batch("proc", "node-a", cols, created_ns=ts_ns)


def test_placement_columns_cross_the_wire_and_pass_the_workers_admission(tmp_path):
    ident = resolved(tmp_path, kubelet=True)
    got = decode(encode(placed_batch(ident, 1_700_000_000 * 10**9)))
    validate(got)
    check_strings(got)
    for name, want in zip(PLACEMENT_COLUMNS, ident.placement()):
        col = got.columns[name]
        assert [col.values[c] for c in col.codes.tolist()] == [want] * got.count


def test_a_mistyped_or_unprintable_placement_column_is_refused(tmp_path):
    batch = placed_batch(resolved(tmp_path, kubelet=True), 1_700_000_000 * 10**9)
    batch.columns["pod"] = np.zeros(batch.count, "<i4")
    with pytest.raises(WireError, match="column 'pod' must be a string column"):
        validate(batch)
    batch.columns["pod"] = StrColumn.constant("evil\nline", batch.count)
    with pytest.raises(AdmissionError, match="pod"):
        check_strings(batch)


def test_the_store_has_placement_columns_and_rows_without_them_read_empty(store):
    described = {r[0]: (r[1], r[3]) for r in store.query("DESCRIBE TABLE raw_metrics").rows}
    for name in PLACEMENT_COLUMNS:
        assert described[name] == ("LowCardinality(String)", "''"), described.get(name)
    node = Batch("host", "node-a", {
        "ts_ns": np.full(1, time.time_ns(), "<i8"), "tenant": StrColumn.constant("_node", 1),
        "job": StrColumn.constant("node-a", 1), "rank": np.full(1, -1, "<i4"), "pid": np.zeros(1, "<i4"),
        "gpu": np.full(1, -1, "<i2"), "metric": StrColumn.of(["cpu.user"]), "device": StrColumn.of(["all"]),
        "value": np.ones(1, "<f8"), "interval_ns": np.full(1, 10**9, "<i8")}, created_ns=time.time_ns())
    assert RawSink(store).write([node]) == []
    assert store.query("SELECT pod, namespace, container FROM raw_metrics").rows == [("", "", "")]


def test_a_pod_process_rows_land_in_the_store_with_pod_namespace_and_container(store, tmp_path):
    """The worker's real path in-process (StreamProcessor with a store runs the sink's writer): a batch of a
    resolved pod process beside a node batch without placement; each row keeps its own."""
    from fleetscope.config import Config
    from fleetscope.streams.processor import MessageRef, StreamProcessor
    ident = resolved(tmp_path, kubelet=True)
    now = time.time_ns()
    node = placed_batch(ident, now, n=2)
    for name in PLACEMENT_COLUMNS:
        del node.columns[name]
    node = Batch("proc", "node-a", {**node.columns, "tenant": StrColumn.constant("_node", 2),
                                    "job": StrColumn.constant("node-a", 2)}, created_ns=now)
    proc = StreamProcessor(Config(data_dir=tmp_path, window_s=1.0), store)
    for offset, batch in enumerate((placed_batch(ident, now), node)):
        proc.handle(encode(batch), None, MessageRef("fleetscope.raw.proc", 0, offset))
    proc.flush(force=True)
    rows = store.query("SELECT tenant, pod, namespace, container, count() FROM raw_metrics "
                       "GROUP BY tenant, pod, namespace, container ORDER BY tenant").rows
    assert rows == [("_node", "", "", "", 2), ("team-vision", "trainer-0", "team-vision", "trainer", 3)]

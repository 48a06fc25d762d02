"""Per-process producers publish each process's pod, namespace and container, and the store keeps them.

Kubernetes and the container runtime are stand-ins (this machine has neither): the process is a real child,
sampled from the real /proc by the real process sampler, but the identity resolver reads it through a mirror
of its /proc directory whose `cgroup` file holds the path containerd writes for a pod's container
(tests/support/fake_proc.py); its stat, environ and exe are the real ones, linked. The kubelet's pod list is a
file in its own JSON shape. The wire codec, the worker (StreamProcessor with its raw sink) and the store
(chDB, migrated) are the real ones. NVML is the C stand-in library (fleetscope.eval.gpu_stub).
"""
from __future__ import annotations

import os
import time

import numpy as np

from fleetscope.config import Config
from fleetscope.producers.identity import IdentityResolver, IdentityRules
from fleetscope.producers.nvml.sampler import NvmlSampler
from fleetscope.producers.process_sampler import ProcessSampler
from fleetscope.producers.tenant_sources import TenantSources
from fleetscope.producers.tracers.discovery import TargetSpec
from fleetscope.producers.tracers.rows import RowIdentity, identity, metric_batch
from fleetscope.schema import NODE_TENANT, PLACEMENT_COLUMNS, validate
from fleetscope.streams.processor import MessageRef, StreamProcessor
from fleetscope.wire import decode, encode
from support.fake_proc import CID, CONTAINERD_POD_CGROUP, POD, fake_proc, kubelet_pods_file
from support.nvml_stub import nvml_scenario, stub_lib  # noqa: F401 (fixtures)
from support.processes import spawn, wait_until  # noqa: F401 (spawn is a fixture)

HOST = "node-a"
PLACED = ("trainer-0", "team-vision", "trainer")  # what kubelet_pods_file names


def mirror_proc(root, pid: int, cgroup: str) -> None:
    """root/<pid> shows the real process (stat, environ, exe linked to /proc/<pid>) in the given cgroup."""
    d = root / str(pid)
    d.mkdir(parents=True)
    for name in ("stat", "environ", "exe"):
        os.symlink(f"/proc/{pid}/{name}", d / name)
    (d / "cgroup").write_text(cgroup)


def pod_resolver(tmp_path) -> IdentityResolver:
    sources = TenantSources(kubelet_pods=str(kubelet_pods_file(tmp_path / "pods.json")))
    return IdentityResolver(IdentityRules(sources=sources), proc_root=tmp_path / "proc", host=HOST)


def decoded(batch, name: str) -> list[str]:
    col = batch.columns[name]
    return [col.values[c] for c in col.codes.tolist()]


def test_a_pod_process_sampled_from_proc_is_stored_with_its_placement(spawn, store, tmp_path):  # noqa: F811
    """Two real ranks: one in a pod's container, one on the bare node (a systemd user slice). Their rows go
    through the wire and the worker into chDB; each keeps its own placement ('' for the bare one)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "FLEETSCOPE_JOB")}
    in_pod = spawn({**env, "RANK": "0", "FLEETSCOPE_JOB": "llm"})
    bare = spawn({**env, "RANK": "1", "FLEETSCOPE_JOB": "llm"})
    mirror_proc(tmp_path / "proc", in_pod.pid, CONTAINERD_POD_CGROUP)
    mirror_proc(tmp_path / "proc", bare.pid, "0::/user.slice/user-0.slice/session-1.scope\n")
    resolver = pod_resolver(tmp_path)
    sampler = ProcessSampler(HOST, resolver, targets=TargetSpec(pids=(in_pod.pid, bare.pid)), poll_s=0.0)
    batches = [sampler.sample(time.time_ns())]
    wait_until(lambda: time.time_ns() > batches[0].created_ns)  # the second read's counters cover an interval
    batches.append(sampler.sample(time.time_ns()))
    assert all(b is not None for b in batches)

    worker = StreamProcessor(Config(data_dir=tmp_path, window_s=1.0), store)
    for offset, batch in enumerate(batches):
        worker.handle(encode(batch), None, MessageRef("fleetscope.raw.proc", 0, offset))
    worker.flush(force=True)
    stored = store.query("SELECT pid, tenant, job, rank, pod, namespace, container, count() FROM raw_metrics "
                         "GROUP BY pid, tenant, job, rank, pod, namespace, container ORDER BY rank").rows
    assert [row[:7] for row in stored] == [(in_pod.pid, "team-vision", "llm", 0, *PLACED),
                                           (bare.pid, "default", "llm", 1, "", "", "")]
    rows_sent = sum(b.count for b in batches)
    assert sum(row[7] for row in stored) == rows_sent and stored[0][7] >= 3  # every row stored, none dropped
    assert resolver.stats["resolved"] == 2  # placement came with the cached identity: resolved once per pid


def test_without_the_kubelet_a_pod_process_carries_its_pod_uid_and_container_id(spawn, tmp_path):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    proc = spawn({**env, "RANK": "0"})
    mirror_proc(tmp_path / "proc", proc.pid, CONTAINERD_POD_CGROUP)
    resolver = IdentityResolver(IdentityRules(), proc_root=tmp_path / "proc", host=HOST)
    batch = decode(encode(ProcessSampler(HOST, resolver, targets=TargetSpec(pids=(proc.pid,)), poll_s=0.0).sample()))
    validate(batch)
    assert {tuple(decoded(batch, name)[i] for name in PLACEMENT_COLUMNS) for i in range(batch.count)} == \
        {(POD, "", CID[:12])}


def test_placement_columns_are_one_dictionary_entry_per_process_and_absent_from_node_batches():
    """metric_batch, which every tracer uses: string columns come from each process's value through codes; a
    batch of node rows (pid 0, as the kernel tracer's TCP and IRQ rows) carries no placement columns."""
    idents = {0: RowIdentity(NODE_TENANT, HOST, -1, -1),
              11: RowIdentity("vision", "llm", 0, 0, ("trainer-0", "team-vision", "trainer")),
              12: RowIdentity("vision", "llm", 1, 1, ("trainer-1", "team-vision", "trainer")),
              13: RowIdentity("default", "etl", -1, -1)}
    rows = [(f"m{k}", "d", float(k), pid) for k, pid in enumerate([11, 0, 12, 11, 13, 12, 11])]
    batch = metric_batch("kernel", HOST, rows, 5, 10, idents.__getitem__)
    validate(batch)
    assert decoded(batch, "pod") == ["trainer-0", "", "trainer-1", "trainer-0", "", "trainer-1", "trainer-0"]
    assert decoded(batch, "namespace") == ["team-vision", "", "team-vision", "team-vision", "", "team-vision",
                                           "team-vision"]
    assert batch.columns["container"].values == ("", "trainer")  # one entry per distinct value, not per row
    assert batch.columns["pod"].values == ("", "trainer-0", "trainer-1")
    assert decoded(batch, "tenant") == ["vision", NODE_TENANT, "vision", "vision", "default", "vision", "vision"]
    assert batch.columns["rank"].tolist() == [0, -1, 1, 0, -1, 1, 0]
    assert batch.columns["gpu"].tolist() == [0, -1, 1, 0, -1, 1, 0]
    assert batch.columns["pid"].tolist() == [11, 0, 12, 11, 13, 12, 11]

    node_only = metric_batch("kernel", HOST, [("kernel.irq_count", "cpu0", 3.0, 0)], 5, 10,
                             lambda pid: identity(None, HOST, pid))
    assert not set(PLACEMENT_COLUMNS) & set(node_only.columns)


def test_nvml_process_rows_carry_placement_and_device_rows_do_not(nvml_scenario, stub_lib, tmp_path):  # noqa: F811
    fake_proc(tmp_path / "proc", 4100, environ=b"FLEETSCOPE_JOB=llm\0RANK=1\0", cgroup=CONTAINERD_POD_CGROUP)
    nvml_scenario("device_count 1\ngpu 0 gpu_util 1\ngpu 0 mem_util 1\n"
                  "gpu 0 proc 4100 1073741824\ngpu 0 proc 777 4096\n")
    sampler = NvmlSampler(HOST, resolver=pod_resolver(tmp_path), library_path=stub_lib)
    try:
        batch = decode(encode(sampler.sample(10**9)))
    finally:
        sampler.close()
    validate(batch)
    pids = batch.columns["pid"].tolist()
    placed = {(pid, *(decoded(batch, name)[i] for name in PLACEMENT_COLUMNS)) for i, pid in enumerate(pids)}
    # 4100 is in the pod; 777 is gone (not in /proc), so unattributed; pid 0 are the GPU's own rows
    assert placed == {(4100, *PLACED), (777, "", "", ""), (0, "", "", "")}
    assert np.count_nonzero(np.array(pids) == 0) >= 2
    assert decoded(batch, "tenant")[pids.index(4100)] == "team-vision"

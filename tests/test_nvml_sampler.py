"""NvmlSampler and XidWatcher against a scripted NVML, without a GPU.

The library under test here is tests/nvml_stub/fake_nvml.c, a small C
stand-in for libnvidia-ml.so.1 built in this test session (see its README).
It is for these tests ONLY: the agent uses the NVIDIA driver's library. The
sampler still goes through pynvml's real ctypes calls, error classes and
struct layouts; only the values and failures are scripted.

The identity resolver here is a tiny fake (a dict of pid -> identity); the
real one is producers/identity.py.
"""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from fleetscope import schema, wire
from fleetscope.producers.nvml.calls import DeviceCalls
from fleetscope.producers.nvml.device_metrics import THROTTLE_FLAGS
from fleetscope.producers.nvml.gpm import GPM_METRICS
from fleetscope.producers.nvml.sampler import NvmlSampler
from fleetscope.producers.nvml.xid_watcher import XidWatcher
from support.nvml_stub import nvml_scenario, stub_lib  # noqa: F401 - fixtures

HOST = "node-a"
SEC = 1_000_000_000
MIB = 1 << 20
FI_NVLINK_TX, FI_NVLINK_RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
FI_NVLINK_ERRORS = (pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
                    pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
                    pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
                    pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL)


def gpu_lines(i: int) -> str:
    """Every device feature scripted, so a GPU with this text reports no 'unsupported'."""
    return f"""
gpu {i} gpu_util 90
gpu {i} mem_util 40
gpu {i} mem_total {80 * 1024 * MIB}
gpu {i} mem_used {20 * 1024 * MIB}
gpu {i} power_mw 250000
gpu {i} energy_mj 1000 2000 3500
gpu {i} temp_c 61
gpu {i} sm_clock 1500
gpu {i} sm_clock_max 1980
gpu {i} mem_clock 2619
gpu {i} mem_clock_max 2619
gpu {i} throttle 0
gpu {i} pcie_tx 1200
gpu {i} pcie_rx 3400
gpu {i} pcie_replay 5 7
gpu {i} ecc_corrected_volatile 2
gpu {i} ecc_uncorrected_volatile 0
gpu {i} ecc_corrected_aggregate 9
gpu {i} ecc_uncorrected_aggregate 1
gpu {i} remapped_corr 3
gpu {i} remapped_unc 1
gpu {i} remapped_pending 0
gpu {i} remapped_failure 0
gpu {i} field {FI_NVLINK_TX} 1000 1600
gpu {i} field {FI_NVLINK_RX} 2000 2100
""" + "".join(f"gpu {i} field {fid} 4 6\n" for fid in FI_NVLINK_ERRORS)


def gpm_lines(i: int, tensor: float = 50.0) -> str:
    lines = [f"gpu {i} gpm_supported 1"]
    for metric_id, name in GPM_METRICS:
        value = tensor if name == "nvml.gpm.tensor_util" else 10.0 + metric_id
        lines.append(f"gpu {i} gpm {metric_id} {value}")
    return "\n".join(lines) + "\n"


FULL = "device_count 2\n" + gpu_lines(0) + gpm_lines(0) + gpu_lines(1)


class FakeResolver:
    """Stands in for producers/identity.py: pid -> object with tenant, job, rank."""

    def __init__(self, table: dict[int, tuple[str, str, int]]):
        self.table = table

    def resolve(self, pid: int):
        if pid not in self.table:
            return None
        tenant, job, rank = self.table[pid]
        return SimpleNamespace(tenant=tenant, job=job, rank=rank)


@pytest.fixture
def scenario(nvml_scenario):
    return nvml_scenario


@pytest.fixture
def make_sampler(stub_lib):
    made = []

    def make(resolver=None, **kwargs) -> NvmlSampler:
        kwargs.setdefault("library_path", stub_lib)
        s = NvmlSampler(HOST, resolver=resolver, **kwargs)
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()  # NVML's init count back to 0, so the next scenario is read afresh


def checked(batch: wire.Batch | None) -> list[dict]:
    """Rows of a batch, after asserting it validates and survives the wire."""
    assert batch is not None
    schema.validate(batch)
    assert list(batch.columns) == list(schema.SOURCE_COLUMNS["nvml"])
    back = wire.decode(wire.encode(batch), batch.kafka_headers())
    schema.validate(back)
    assert (back.source, back.host, back.count) == ("nvml", HOST, batch.count)
    cols = {k: (v.to_numpy() if isinstance(v, wire.StrColumn) else v) for k, v in back.columns.items()}
    return [{k: (c[i].item() if hasattr(c[i], "item") else c[i]) for k, c in cols.items()} for i in range(back.count)]


def device_rows(rows: list[dict]) -> dict[tuple[str, str], dict]:
    out = {(r["metric"], r["device"]): r for r in rows if r["pid"] == 0}
    assert len(out) == sum(r["pid"] == 0 for r in rows), "a (metric, device) pair appeared twice"
    return out


def statuses(rows: list[dict]) -> set[tuple[str, str, float]]:
    kinds = ("nvml.status", "nvml.unsupported", "nvml.gpu_lost")
    return {(r["metric"], r["device"], r["value"]) for r in rows if r["metric"] in kinds}


def ticks(sampler: NvmlSampler, n: int, start_s: int = 1, step_ns: int = SEC) -> list[list[dict]]:
    return [checked(sampler.sample(start_s * SEC + i * step_ns)) for i in range(n)]


# -- decoded output ---------------------------------------------------------

def test_device_gauges_are_decoded_with_units(scenario, make_sampler):
    scenario(FULL)
    rows = checked(make_sampler().sample(5 * SEC))
    d = device_rows(rows)
    expect = {"nvml.gpu_util": 90, "nvml.mem_util": 40, "nvml.mem_total": 80 * 1024 * MIB,
              "nvml.mem_used": 20 * 1024 * MIB, "nvml.power_w": 250.0, "nvml.temp_c": 61,
              "nvml.sm_clock_mhz": 1500, "nvml.sm_clock_max_mhz": 1980, "nvml.mem_clock_mhz": 2619,
              "nvml.mem_clock_max_mhz": 2619, "nvml.pcie_tx_kbps": 1200, "nvml.pcie_rx_kbps": 3400,
              "nvml.ecc.corrected_volatile": 2, "nvml.ecc.uncorrected_volatile": 0,
              "nvml.ecc.corrected_aggregate": 9, "nvml.ecc.uncorrected_aggregate": 1,
              "nvml.remapped_rows.correctable": 3, "nvml.remapped_rows.uncorrectable": 1,
              "nvml.remapped_rows.pending": 0, "nvml.remapped_rows.failure": 0}
    for gpu in (0, 1):
        for metric, value in expect.items():
            row = d[(metric, f"gpu{gpu}")]
            assert row["value"] == value, metric
            assert (row["gpu"], row["interval_ns"], row["ts_ns"]) == (gpu, 0, 5 * SEC)
            assert (row["tenant"], row["job"], row["rank"]) == (schema.NODE_TENANT, HOST, -1)
    # Counters say nothing until they have a previous sample.
    assert not any(r["metric"] in ("nvml.energy_j", "nvml.pcie_replay") or r["metric"].startswith("nvml.nvlink.")
                   for r in rows)
    assert statuses(rows) == {("nvml.unsupported", "gpu1:gpm", 1.0)}


def test_energy_is_joules_since_the_previous_sample_and_a_reset_gives_no_delta(scenario, make_sampler):
    scenario("device_count 1\ngpu 0 gpu_util 1\ngpu 0 mem_util 1\ngpu 0 energy_mj 1000 2000 3500 500 900\n")
    out = [device_rows(rows).get(("nvml.energy_j", "gpu0")) for rows in ticks(make_sampler(), 5, step_ns=2 * SEC)]
    assert out[0] is None
    assert (out[1]["value"], out[1]["interval_ns"]) == (pytest.approx(1.0), 2 * SEC)
    assert (out[2]["value"], out[2]["interval_ns"]) == (pytest.approx(1.5), 2 * SEC)
    assert out[3] is None  # 3500 -> 500: the counter was reset (driver reload)
    assert (out[4]["value"], out[4]["interval_ns"]) == (pytest.approx(0.4), 2 * SEC)


def test_throttle_bitmask_decodes_into_one_gauge_per_flag(scenario, make_sampler):
    mask = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    scenario(f"device_count 1\ngpu 0 gpu_util 1\ngpu 0 mem_util 1\ngpu 0 throttle {mask}\n")
    d = device_rows(checked(make_sampler().sample(SEC)))
    assert d[("nvml.throttle_reasons", "gpu0")]["value"] == float(mask)
    flags = {name: d[(f"nvml.throttle.{name}", "gpu0")]["value"] for name, _ in THROTTLE_FLAGS}
    assert flags == {"sw_power_cap": 1.0, "hw_thermal_slowdown": 1.0, "hw_slowdown": 0.0,
                     "hw_power_brake_slowdown": 0.0, "sw_thermal_slowdown": 0.0, "sync_boost": 0.0,
                     "gpu_idle": 0.0, "applications_clocks_setting": 0.0, "display_clock_setting": 0.0}


def test_counters_for_pcie_replay_and_nvlink_become_deltas(scenario, make_sampler):
    scenario(FULL)
    second = device_rows(ticks(make_sampler(), 2)[1])
    assert (second[("nvml.pcie_replay", "gpu0")]["value"], second[("nvml.pcie_replay", "gpu0")]["interval_ns"]) \
        == (2.0, SEC)
    assert second[("nvml.nvlink.tx_kib", "gpu0")]["value"] == 600.0
    assert second[("nvml.nvlink.rx_kib", "gpu1")]["value"] == 100.0
    for name in ("crc_flit_errors", "crc_data_errors", "replay_errors", "recovery_errors"):
        assert second[(f"nvml.nvlink.{name}", "gpu0")]["value"] == 2.0


def test_per_process_rows_carry_the_resolved_identity(scenario, make_sampler):
    scenario("device_count 2\n" + "".join(f"gpu {i} gpu_util 1\ngpu {i} mem_util 1\n" for i in (0, 1))
             + "gpu 0 proc 4242 1073741824\ngpu 0 proc 777 4096\ngpu 1 proc 4343 2048\n"
             + "gpu 0 putil 4242 87 40\ngpu 1 putil 4343 12 5\n")
    resolver = FakeResolver({4242: ("acme", "llama-70b", 3), 4343: ("acme", "llama-70b", 4)})
    rows = checked(make_sampler(resolver=resolver).sample(SEC))
    procs = {(r["metric"], r["pid"]): r for r in rows if r["pid"] != 0}
    r = procs[("nvml.proc_mem_used", 4242)]
    assert (r["value"], r["gpu"], r["device"], r["tenant"], r["job"], r["rank"]) == \
        (1073741824.0, 0, "gpu0", "acme", "llama-70b", 3)
    assert (procs[("nvml.proc_sm_util", 4242)]["value"], procs[("nvml.proc_mem_util", 4242)]["value"]) == (87, 40)
    r = procs[("nvml.proc_sm_util", 4343)]
    assert (r["value"], r["gpu"], r["tenant"], r["rank"]) == (12, 1, "acme", 4)
    # A pid the resolver does not know keeps its pid and GPU, with the node identity.
    r = procs[("nvml.proc_mem_used", 777)]
    assert (r["value"], r["gpu"], r["tenant"], r["job"], r["rank"]) == (4096.0, 0, schema.NODE_TENANT, HOST, -1)


def test_gpm_metrics_start_on_the_second_tick_and_give_ofu(scenario, make_sampler):
    scenario(FULL)
    first, second = ticks(make_sampler(), 2)
    assert not any(r["metric"].startswith("nvml.gpm.") or r["metric"] == "nvml.ofu" for r in first)
    d = device_rows(second)
    for metric_id, name in GPM_METRICS:
        assert d[(name, "gpu0")]["value"] == (50.0 if name == "nvml.gpm.tensor_util" else 10.0 + metric_id)
    assert d[("nvml.ofu", "gpu0")]["value"] == pytest.approx(50.0 * 1500 / 1980)
    assert ("nvml.ofu", "gpu1") not in d  # GPU 1 has no GPM
    assert statuses(second) == set()  # GPU 1's "no GPM" came once, on the first tick


# -- degradation ------------------------------------------------------------

def test_missing_library_path_gives_one_status_row_then_none(make_sampler, caplog):
    s = make_sampler(library_path="/nonexistent/libnvidia-ml.so.1")
    rows = checked(s.sample(SEC))
    assert statuses(rows) == {("nvml.status", "library", 0.0)} and len(rows) == 1
    assert rows[0]["gpu"] == -1
    assert s.sample(2 * SEC) is None
    assert "cannot load NVML library" in caplog.text


def test_nvml_init_failure_gives_an_init_status(scenario, make_sampler):
    scenario("init_fail DRIVER_NOT_LOADED\n")
    s = make_sampler()
    assert statuses(checked(s.sample(SEC))) == {("nvml.status", "init", 0.0)}
    assert s.sample(2 * SEC) is None


def test_no_gpu_gives_a_status_then_none(scenario, make_sampler, caplog):
    scenario("device_count 0\n")
    s = make_sampler()
    assert statuses(checked(s.sample(SEC))) == {("nvml.status", "no_gpu", 0.0)}
    assert s.sample(2 * SEC) is None
    assert "sees no GPU" in caplog.text


def test_unsupported_field_is_skipped_on_that_gpu_with_one_status(scenario, make_sampler, caplog):
    scenario(FULL + "gpu 1 fail power_mw NOT_SUPPORTED\n")
    s = make_sampler()
    first, second, third = ticks(s, 3)
    assert statuses(first) == {("nvml.unsupported", "gpu1:power", 1.0), ("nvml.unsupported", "gpu1:gpm", 1.0)}
    for rows in (first, second, third):
        d = device_rows(rows)
        assert ("nvml.power_w", "gpu1") not in d and d[("nvml.power_w", "gpu0")]["value"] == 250.0
        assert ("nvml.gpu_util", "gpu1") in d
    assert statuses(second) == statuses(third) == set()
    assert s.errors == {}
    assert caplog.text.count("does not support 'power'") == 1


def test_unscripted_nvlink_fields_are_each_reported_unsupported_once(scenario, make_sampler):
    scenario(f"device_count 1\ngpu 0 gpu_util 1\ngpu 0 mem_util 1\ngpu 0 field {FI_NVLINK_TX} 10 30\n")
    first, second = ticks(make_sampler(), 2)
    assert {d for m, d, _ in statuses(first) if d.startswith("gpu0:nvlink.")} == {
        "gpu0:nvlink.rx_kib", "gpu0:nvlink.crc_flit_errors", "gpu0:nvlink.crc_data_errors",
        "gpu0:nvlink.replay_errors", "gpu0:nvlink.recovery_errors"}
    assert statuses(second) == set()
    assert device_rows(second)[("nvml.nvlink.tx_kib", "gpu0")]["value"] == 20.0


def test_gpu_lost_mid_run_is_reported_once_and_the_other_gpu_keeps_reporting(scenario, make_sampler, caplog):
    scenario(FULL + "gpu 0 lost_after 2\n")
    out = ticks(make_sampler(), 4)
    for rows in out[:2]:
        assert ("nvml.gpu_util", "gpu0") in device_rows(rows)
    assert ("nvml.gpu_lost", "gpu0", 1.0) in statuses(out[2])
    for rows in out[2:]:
        assert not any(r["gpu"] == 0 and r["metric"] != "nvml.gpu_lost" for r in rows)
        d = device_rows(rows)
        assert d[("nvml.gpu_util", "gpu1")]["value"] == 90 and ("nvml.energy_j", "gpu1") in d
    assert statuses(out[3]) == set()
    assert caplog.text.count("GPU 0 fell off the bus") == 1


def test_other_nvml_errors_are_counted_and_skip_the_field_for_that_tick(scenario, make_sampler):
    scenario(FULL + "gpu 0 fail temp_c UNKNOWN\n")
    s = make_sampler()
    out = ticks(s, 3)
    assert s.errors == {"temperature": 3}
    for rows in out:
        d = device_rows(rows)
        assert ("nvml.temp_c", "gpu0") not in d and ("nvml.temp_c", "gpu1") in d
        assert not any(m == "nvml.unsupported" and "temperature" in dev for m, dev, _ in statuses(rows))


def test_no_process_utilization_samples_means_no_rows_and_no_error(scenario, make_sampler):
    scenario("device_count 1\ngpu 0 gpu_util 1\ngpu 0 mem_util 1\ngpu 0 proc 4242 4096\n")
    s = make_sampler(resolver=FakeResolver({}))
    for rows in ticks(s, 2):
        assert not any(r["metric"] in ("nvml.proc_sm_util", "nvml.proc_mem_util") for r in rows)
        assert any(r["metric"] == "nvml.proc_mem_used" and r["pid"] == 4242 for r in rows)
        assert not any("process_util" in dev for _, dev, _ in statuses(rows))
    assert s.errors == {}


def test_pcie_throughput_is_read_at_most_once_per_interval(scenario, make_sampler):
    scenario(FULL)
    out = ticks(make_sampler(pcie_min_interval_ns=SEC), 12, step_ns=SEC // 10)
    read = [("nvml.pcie_tx_kbps", "gpu0") in device_rows(rows) for rows in out]
    assert read == [True] + [False] * 9 + [True, False]


# -- XidWatcher -------------------------------------------------------------

def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the XidWatcher"
        time.sleep(0.01)


def test_a_scripted_xid_79_is_published_at_once(scenario, stub_lib):
    events = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
    scenario(f"device_count 2\ngpu 1 events_supported {events}\ngpu 1 xid 79\n")
    published: list[wire.Batch] = []
    watcher = XidWatcher(HOST, published.append, library_path=stub_lib, wait_ms=20).start()
    try:
        wait_for(lambda: published)
    finally:
        watcher.stop()
    assert not watcher.running
    rows = checked(published[0])
    assert [(r["metric"], r["device"], r["value"], r["gpu"]) for r in rows] == [("nvml.xid", "gpu1", 79.0, 1)]
    assert len(published) == 1  # GPU 0 supports no events: skipped quietly, and no status since GPU 1 does


def test_xid_watcher_without_event_support_publishes_one_status_and_exits(scenario, stub_lib):
    scenario("device_count 1\n")
    published: list[wire.Batch] = []
    watcher = XidWatcher(HOST, published.append, library_path=stub_lib, wait_ms=20).start()
    wait_for(lambda: not watcher.running)
    assert [statuses(checked(b)) for b in published] == [{("nvml.status", "events", 0.0)}]


def test_device_energy_is_split_over_processes_by_sm_utilization(scenario, make_sampler):
    scenario("device_count 1\ngpu 0 gpu_util 1\ngpu 0 mem_util 1\ngpu 0 energy_mj 1000 11000\n"
             "gpu 0 proc 4242 4096\ngpu 0 proc 4343 4096\ngpu 0 putil 4242 60 1\ngpu 0 putil 4343 20 1\n")
    resolver = FakeResolver({4242: ("acme", "train", 0), 4343: ("beta", "infer", 0)})
    second = ticks(make_sampler(resolver=resolver), 2)[1]
    energy = {r["tenant"]: r for r in second if r["metric"] == "nvml.proc_energy_j"}
    # 10 J over the tick, 60:20 SM utilization
    assert energy["acme"]["value"] == pytest.approx(7.5) and energy["beta"]["value"] == pytest.approx(2.5)
    assert energy["acme"]["interval_ns"] == SEC and energy["acme"]["gpu"] == 0


def test_energy_split_without_utilization_samples_is_equal_and_never_lost():
    from fleetscope.producers.nvml.energy import split_energy
    assert split_energy(9.0, {}, {1, 2, 3}) == {1: 3.0, 2: 3.0, 3: 3.0}
    assert split_energy(9.0, {1: 0.0}, {1, 2}) == {1: 4.5, 2: 4.5}
    assert split_energy(5.0, {}, set()) == {}


# -- batched reads and cadence (cost work) ------------------------------------

def test_a_field_nvml_cannot_batch_falls_back_to_its_getter_without_a_status(scenario, make_sampler):
    # Field 186 (instantaneous power) answers NOT_SUPPORTED per field, as on a driver that predates it,
    # while nvmlDeviceGetPowerUsage still answers: the value comes through the getter, nothing is "unsupported".
    scenario(FULL + f"gpu 0 field_fail {pynvml.NVML_FI_DEV_POWER_INSTANT} NOT_SUPPORTED\n")
    s = make_sampler()
    for rows in ticks(s, 3):
        assert device_rows(rows)[("nvml.power_w", "gpu0")]["value"] == 250.0
        assert not any("power" in dev for _, dev, _ in statuses(rows))
    assert s.errors == {}


def test_a_failed_field_costs_that_field_only_and_other_errors_are_counted(scenario, make_sampler):
    scenario(FULL + f"gpu 0 field_fail {FI_NVLINK_RX} UNKNOWN\n")
    s = make_sampler()
    second = device_rows(ticks(s, 2)[1])
    assert ("nvml.nvlink.rx_kib", "gpu0") not in second and second[("nvml.nvlink.tx_kib", "gpu0")]["value"] == 600
    assert second[("nvml.energy_j", "gpu0")]["value"] == pytest.approx(1.0)
    assert s.errors == {"nvlink.rx_kib": 2}


def test_slow_and_static_groups_are_read_on_their_cadence_and_counters_every_tick(scenario, make_sampler):
    scenario(FULL + "gpu 0 proc 4242 4096\ngpu 0 putil 4242 50 10\n")
    s = make_sampler(slow_interval_ns=SEC // 2, static_interval_ns=SEC)
    out = [device_rows(rows) for rows in ticks(s, 11, step_ns=SEC // 10)]
    has = lambda metric: [(metric, "gpu0") in d for d in out]  # noqa: E731
    assert has("nvml.gpu_util") == [True] * 11
    assert has("nvml.energy_j") == [False] + [True] * 10  # a counter: a delta every tick after the first
    assert has("nvml.temp_c") == [True, False, False, False, False, True, False, False, False, False, True]
    assert has("nvml.ecc.corrected_volatile") == [True] + [False] * 9 + [True]
    assert has("nvml.sm_clock_max_mhz") == has("nvml.mem_total") == has("nvml.ecc.corrected_volatile")
    assert all(d[("nvml.energy_j", "gpu0")]["interval_ns"] == SEC // 10 for d in out[1:])


def test_process_energy_covers_every_tick_since_the_previous_split(scenario, make_sampler):
    # energy 1000 mJ, then +500 mJ a tick; processes (and the split) every 0.5 s on a 0.1 s tick.
    scenario("device_count 1\ngpu 0 gpu_util 1\ngpu 0 mem_util 1\n"
             "gpu 0 energy_mj " + " ".join(str(1000 + 500 * i) for i in range(12)) + "\n"
             "gpu 0 proc 4242 4096\ngpu 0 proc 4343 4096\ngpu 0 putil 4242 30 1\ngpu 0 putil 4343 10 1\n")
    s = make_sampler(resolver=FakeResolver({4242: ("acme", "train", 0), 4343: ("beta", "infer", 1)}),
                     slow_interval_ns=SEC // 2)
    out = ticks(s, 11, step_ns=SEC // 10)
    splits = [[r for r in rows if r["metric"] == "nvml.proc_energy_j"] for rows in out]
    assert [bool(x) for x in splits] == [False] * 5 + [True] + [False] * 4 + [True]
    for rows in (splits[5], splits[10]):
        by_tenant = {r["tenant"]: r for r in rows}
        # 5 ticks x 0.5 J = 2.5 J over 0.5 s, split 30:10
        assert by_tenant["acme"]["value"] == pytest.approx(1.875) and by_tenant["beta"]["value"] == pytest.approx(0.625)
        assert by_tenant["acme"]["interval_ns"] == SEC // 2 and by_tenant["beta"]["rank"] == 1
    device_energy = sum(r["value"] for rows in out for r in rows if r["metric"] == "nvml.energy_j")
    assert sum(r["value"] for rows in splits for r in rows) == pytest.approx(device_energy)


def test_gpm_is_read_once_a_second_and_ofu_uses_the_intervals_mean_sm_clock(scenario, make_sampler):
    scenario("device_count 1\ngpu 0 gpu_util 1\ngpu 0 mem_util 1\ngpu 0 sm_clock_max 2000\n"
             "gpu 0 sm_clock 1000 1000 1000 1000 1000 1000 1000 1000 1000 1000 1000 2000 2000 2000 2000 2000\n"
             + gpm_lines(0, tensor=60.0))
    out = [device_rows(rows) for rows in ticks(make_sampler(), 21, step_ns=SEC // 10)]
    assert [("nvml.gpm.tensor_util", "gpu0") in d for d in out] == ([False] * 10 + [True] + [False] * 9 + [True])
    # Tick 0 takes the first GPM sample; ticks 1..10 read SM clock 1000, ticks 11..20 read 2000 (the last value repeats).
    assert out[10][("nvml.ofu", "gpu0")]["value"] == pytest.approx(60.0 * 1000 / 2000)
    assert out[20][("nvml.ofu", "gpu0")]["value"] == pytest.approx(60.0 * 2000 / 2000)


def test_the_one_call_tick_path_gives_the_rows_of_the_getter_by_getter_path(scenario, make_sampler, monkeypatch):
    # DeviceCalls.tick() reads the every-tick getters in one call; when it
    # answers None the sampler goes getter by getter. Both give the same rows.
    from fleetscope.producers.nvml.calls import DeviceCalls
    scenario(FULL)
    first = make_sampler()
    one_call = [device_rows(rows) for rows in ticks(first, 3, step_ns=SEC // 10)]
    first.close()  # the stand-in rereads its script (and restarts its sequences) at the next init
    monkeypatch.setattr(DeviceCalls, "tick", lambda self: None)
    by_getter = [device_rows(rows) for rows in ticks(make_sampler(), 3, step_ns=SEC // 10)]
    assert [sorted(d) for d in one_call] == [sorted(d) for d in by_getter]
    assert one_call == by_getter


# -- the fast paths and reused columns (steady ticks) ------------------------

def test_steady_ticks_pick_up_every_change_and_a_counter_reset(scenario, make_sampler):
    """Field values on the fast path (same layout, every field answered): a gauge
    that moves, counter deltas, and a reset after many steady ticks."""
    scenario("device_count 1\ngpu 0 gpu_util 1\ngpu 0 mem_util 1\n"
             "gpu 0 power_mw 100000 200000 300000 400000 500000 600000 700000\n"
             "gpu 0 energy_mj 1000 1100 1300 1600 2000 200 300 450\n"
             f"gpu 0 field {FI_NVLINK_TX} 10 20 40 80 160 320 640 1280\n")
    out = [device_rows(rows) for rows in ticks(make_sampler(), 8, step_ns=SEC // 10)]
    assert [d[("nvml.power_w", "gpu0")]["value"] for d in out] == [100.0, 200.0, 300.0, 400.0, 500.0, 600.0,
                                                                  700.0, 700.0]
    energy = [d.get(("nvml.energy_j", "gpu0")) for d in out]
    assert energy[0] is None and energy[5] is None  # the first read; 2000 -> 200, a reset
    assert [e["value"] for e in energy if e is not None] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.1, 0.15])
    assert {e["interval_ns"] for e in energy if e is not None} == {SEC // 10}
    assert [d[("nvml.nvlink.tx_kib", "gpu0")]["value"] for d in out[1:]] == [10.0, 20.0, 40.0, 80.0, 160.0,
                                                                            320.0, 640.0]


def test_reused_columns_follow_a_layout_change(scenario, make_sampler):
    """GPU 1 is lost mid-run: the tick's layout changes (a status row, one GPU
    fewer) and the metric, device and gpu columns must change with it."""
    scenario(FULL + "gpu 1 lost_after 4\n")
    out = ticks(make_sampler(), 8, step_ns=SEC // 10)
    for rows in out:
        for r in rows:
            if r["metric"] not in ("nvml.gpu_lost", "nvml.unsupported"):
                assert r["device"] == f"gpu{r['gpu']}"
    assert {r["gpu"] for r in out[2]} == {0, 1}
    lost_at = next(i for i, rows in enumerate(out) if ("nvml.gpu_lost", "gpu1", 1.0) in statuses(rows))
    assert all({r["gpu"] for r in rows} == {0} for rows in out[lost_at + 1:])
    assert [r["metric"] for r in out[-1]] == [r["metric"] for r in out[-2]]


def test_process_identity_columns_follow_a_changed_identity(scenario, make_sampler):
    """The per-process identity columns are reused while the processes stay the
    same; a pid whose job changes between reads carries the new one."""
    scenario("device_count 1\ngpu 0 gpu_util 1\ngpu 0 mem_util 1\ngpu 0 proc 4242 4096\n")
    resolver = FakeResolver({4242: ("acme", "train", 0)})
    s = make_sampler(resolver=resolver)
    first, second = checked(s.sample(SEC)), checked(s.sample(2 * SEC))
    resolver.table[4242] = ("acme", "eval", 5)
    third = checked(s.sample(3 * SEC))

    def proc(rows):
        (row,) = [r for r in rows if r["metric"] == "nvml.proc_mem_used"]
        return row["tenant"], row["job"], row["rank"], row["pid"]
    assert proc(first) == proc(second) == ("acme", "train", 0, 4242)
    assert proc(third) == ("acme", "eval", 5, 4242)
    assert {(r["tenant"], r["job"], r["rank"], r["pid"]) for r in third if r["metric"] != "nvml.proc_mem_used"
            and r["pid"] == 0} == {(schema.NODE_TENANT, HOST, -1, 0)}


def test_more_processes_than_the_kept_buffer_holds_are_all_read(scenario, make_sampler, monkeypatch):
    """The process list and utilization buffers start small and grow when NVML asks for more."""
    monkeypatch.setattr(DeviceCalls, "LIST_START", 2)
    pids = range(5000, 5012)
    scenario("device_count 1\ngpu 0 gpu_util 1\ngpu 0 mem_util 1\n"
             + "".join(f"gpu 0 proc {pid} {pid}\ngpu 0 putil {pid} 50 5\n" for pid in pids))
    s = make_sampler()
    for t in (1, 2):  # the second read reuses the grown buffers
        rows = checked(s.sample(t * SEC))
        mem = {r["pid"]: r["value"] for r in rows if r["metric"] == "nvml.proc_mem_used"}
        assert mem == {pid: float(pid) for pid in pids}
        assert {r["pid"] for r in rows if r["metric"] == "nvml.proc_sm_util"} == set(pids)


def test_cadence_groups_come_due_on_time_across_many_ticks(scenario, make_sampler):
    """Between slower reads the sampler answers 'only the every-tick group' from
    one comparison; temperature (1 s) and memory total (10 s) still come on time,
    and a group with interval 0 is read every tick."""
    scenario("device_count 1\ngpu 0 gpu_util 1\ngpu 0 mem_util 1\ngpu 0 temp_c 61\ngpu 0 mem_total 1000\n"
             "gpu 0 mem_used 10\n")
    out = ticks(make_sampler(), 25, step_ns=SEC // 10)
    has = [{r["metric"] for r in rows} for rows in out]
    assert [i for i, m in enumerate(has) if "nvml.temp_c" in m] == [0, 10, 20]
    assert [i for i, m in enumerate(has) if "nvml.mem_total" in m] == [0]
    assert all("nvml.gpu_util" in m for m in has)
    every = ticks(make_sampler(slow_interval_ns=0), 5, step_ns=SEC // 10)
    assert all(any(r["metric"] == "nvml.temp_c" for r in rows) for rows in every)

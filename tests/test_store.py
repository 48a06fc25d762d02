"""The store against the real ClickHouse engine (chDB) in tmp_path.

chDB holds one data directory per process, so every test closes its store,
and the cross-process behaviour (endpoint, busy directory) is exercised
from real subprocesses.

There is no ClickHouse server on the test machines: ClickHouseServerStore is
covered only in its pure parts (URL and credential handling, value
conversion); its network calls are not exercised here.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from fleetscope.store import (ChdbStore, QueryEndpoint, RemoteStore, StoreError, endpoint_alive,
                              open_store)
from fleetscope.store import clickhouse_store as chs
from fleetscope.store.base import Prepared
from fleetscope.store.migrations import discover, split_statements
from fleetscope.wire import StrColumn

REPO = Path(__file__).resolve().parents[1]
TABLES = {"schema_migrations", "raw_metrics", "features", "dlq"}


@pytest.fixture
def store(tmp_path):
    s = ChdbStore(tmp_path / "chdb")
    s.migrate()
    yield s
    s.close()


def raw_batch(n: int, metric: str = "cpu_util", ts_ns: int | None = None) -> dict:
    # Recent timestamps: rows older than the TTL would be dropped by the engine.
    ts = (ts_ns or time.time_ns()) + np.arange(n, dtype=np.int64)
    return {
        "source": StrColumn.constant("host", n), "tenant": StrColumn.of(["acme", "beta"] * (n // 2) + ["acme"] * (n % 2)),
        "job": StrColumn.constant("train-1", n), "host": StrColumn.constant("node-a", n),
        "rank": np.arange(n, dtype=np.int32), "pid": np.full(n, 42, dtype=np.int32), "gpu": np.full(n, -1, dtype=np.int16),
        "ts": ts, "metric": [metric] * n, "device": np.array([""] * n, dtype=object),
        "value": np.linspace(0, 1, n), "interval_ns": np.zeros(n, dtype=np.int64),
        "batch_id": StrColumn.constant("b-1", n),
    }


def count(s, table: str = "raw_metrics") -> int:
    return s.query(f"SELECT count() FROM {table}").rows[0][0]


def run_py(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)


# ---- migrations ------------------------------------------------------------------

def test_migrate_is_idempotent_and_creates_tables(tmp_path):
    with ChdbStore(tmp_path / "chdb", ttl_days=3) as s:
        applied = s.migrate()
        assert applied[:4] == ["001_schema_migrations", "002_raw_metrics", "003_features", "004_dlq"]
        assert applied == [path.stem for _, path in discover()]
        assert s.migrate() == []
        tables = {r[0] for r in s.query("SHOW TABLES").rows}
        assert TABLES <= tables
        assert count(s, "schema_migrations") == len(applied)
        meta = {r["name"]: r for r in s.query(
            "SELECT name, sorting_key, engine_full FROM system.tables WHERE database = {db:String}",
            {"db": s.database}).as_dicts()}
        assert meta["raw_metrics"]["sorting_key"] == "tenant, job, rank, ts, metric, device, pid, gpu"
        assert meta["features"]["sorting_key"] == "tenant, job, rank, window_start, host"
        assert meta["dlq"]["sorting_key"] == "topic, ts"
        assert "toIntervalDay(3)" in meta["raw_metrics"]["engine_full"]
        assert "non_replicated_deduplication_window = 10000" in meta["features"]["engine_full"]
    # Reopening the same directory: nothing left to apply.
    with ChdbStore(tmp_path / "chdb", ttl_days=3) as s:
        assert s.migrate() == []


def test_split_statements_ignores_semicolons_in_quotes_and_comments():
    sql = "-- a; comment\nCREATE TABLE a (x String DEFAULT ';');\n/* b; */ SELECT 'it''s;' ;\n\n"
    assert split_statements(sql) == ["CREATE TABLE a (x String DEFAULT ';')", "SELECT 'it''s;'"]


# ---- inserts ---------------------------------------------------------------------

def test_same_dedupe_token_keeps_one_copy(store):
    batch = raw_batch(1000)
    assert store.insert("raw_metrics", batch, dedupe_token="batch-1") == 1000
    store.insert("raw_metrics", batch, dedupe_token="batch-1")  # a retried batch
    assert count(store) == 1000
    store.insert("raw_metrics", batch, dedupe_token="batch-2")  # a different batch
    assert count(store) == 2000


def test_values_round_trip(store):
    t0 = 1_800_000_000_123_456_789  # in the future, so the TTL keeps it
    store.insert("raw_metrics", raw_batch(3, ts_ns=t0), dedupe_token="rt")
    rows = store.query("SELECT tenant, rank, ts, value FROM raw_metrics ORDER BY rank").rows
    assert rows[0] == ("acme", 0, "2027-01-15 08:00:00.123456789", 0.0)
    assert [r[0] for r in rows] == ["acme", "beta", "acme"]
    assert store.query("SELECT toUnixTimestamp64Nano(max(ts)) FROM raw_metrics").rows[0][0] == t0 + 2


def test_features_map_keeps_masked_features_absent(store):
    now = np.datetime64(time.time_ns(), "ns")
    store.insert("features", {
        "tenant": ["acme", "acme"], "job": ["train-1"] * 2, "host": ["node-a"] * 2, "rank": [0, 1],
        "window_start": np.array([now, now]), "window_end": np.array([now, now]) + np.timedelta64(10, "s"),
        "feature_version": np.array([1, 1], dtype=np.uint16),
        "feature": [{"step_time": 0.25, "nccl_wait": 0.0, "gpu_util": float("nan")}, {}],
        "sources": [["cuda", "nccl"], []], "event_count": np.array([7, 0], dtype=np.uint32),
        "emitted_at": np.array([now, now]),
    }, dedupe_token="w1")
    rows = store.query("SELECT rank, feature, sources, mapContains(feature, 'gpu_util') FROM features ORDER BY rank").rows
    assert rows[0] == (0, {"step_time": 0.25, "nccl_wait": 0}, ["cuda", "nccl"], 0)  # NaN -> absent, 0 stays 0
    assert rows[1] == (1, {}, [], 0)


def test_invalid_names_and_columns_are_rejected(store):
    for bad in ("raw_metrics; DROP TABLE dlq", "raw-metrics", "", "`raw_metrics`"):
        with pytest.raises(StoreError, match="invalid table name"):
            store.insert(bad, raw_batch(1))
    with pytest.raises(StoreError, match="unknown columns"):
        store.insert("raw_metrics", {**raw_batch(1), "evil) SELECT 1 --": [1]})
    with pytest.raises(StoreError, match="differ in length"):
        store.insert("raw_metrics", {**raw_batch(2), "rank": np.zeros(3, dtype=np.int32)})
    with pytest.raises(StoreError, match="does not exist"):
        store.insert("no_such_table", {"x": [1]})
    assert TABLES <= {r[0] for r in store.query("SHOW TABLES").rows}


def test_parameters_are_data_not_sql(store):
    evil = "x'; DROP TABLE raw_metrics; --"
    store.insert("raw_metrics", raw_batch(2, metric=evil), dedupe_token="evil")
    store.insert("raw_metrics", raw_batch(2, metric="plain"), dedupe_token="plain")
    res = store.query("SELECT count() AS n, any(metric) AS m FROM raw_metrics WHERE metric = {m:String}", {"m": evil})
    assert res.as_dicts() == [{"n": 2, "m": evil}]
    assert store.query("SELECT {q:String} AS q", {"q": "it's \"quoted\" \\ ;"}).rows == [("it's \"quoted\" \\ ;",)]
    assert count(store) == 4  # the table survived


# ---- the endpoint and the busy directory -----------------------------------------

@pytest.fixture
def served(tmp_path):
    s = ChdbStore(tmp_path / "chdb")
    s.migrate()
    ep = QueryEndpoint(s, tmp_path, stats_provider=lambda: {"events": 7}).start()
    yield s, ep, tmp_path
    ep.stop()
    s.close()


def test_other_process_reaches_the_store_through_the_endpoint(served):
    s, ep, data_dir = served
    s.insert("raw_metrics", raw_batch(10), dedupe_token="local")
    code = f"""
import json, numpy as np, time
from pathlib import Path
from fleetscope.store import open_store
st = open_store(Path({str(data_dir)!r}))
batch = {{"tenant": ["remote"] * 2, "job": ["j"] * 2, "rank": np.array([0, 1], dtype=np.int32),
         "ts": np.array([time.time_ns()] * 2, dtype="datetime64[ns]"), "metric": ["m"] * 2, "value": [1.5, 2.5]}}
n1 = st.insert("raw_metrics", batch, dedupe_token="remote-1")
n2 = st.insert("raw_metrics", batch, dedupe_token="remote-1")
res = st.query("SELECT tenant, count() AS n FROM raw_metrics WHERE tenant != {{skip:String}} GROUP BY tenant ORDER BY tenant",
               {{"skip": "nobody"}})
print(json.dumps({{"kind": type(st).__name__, "n": [n1, n2], "rows": res.as_dicts(), "migrate": st.migrate(),
                  "stats": st.stats()}}))
"""
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["kind"] == "RemoteStore"
    assert out["rows"] == [{"tenant": "acme", "n": 5}, {"tenant": "beta", "n": 5}, {"tenant": "remote", "n": 2}]
    assert out["migrate"] == [] and out["stats"] == {"events": 7}
    assert s.query("SELECT sum(value) FROM raw_metrics WHERE tenant = 'remote'").rows == [(4.0,)]


def test_endpoint_file_is_private_and_tokens_are_checked(served):
    s, ep, data_dir = served
    path = data_dir / "endpoint.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = json.loads(path.read_text())
    assert doc["pid"] == os.getpid() and doc["url"].startswith("http://127.0.0.1:")
    assert endpoint_alive(data_dir)

    def post(token: str | None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        req = urllib.request.Request(doc["url"] + "/query", data=json.dumps({"sql": "SELECT 1"}).encode(),
                                     headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())

    for wrong in ("nope", None, doc["token"] + "x"):
        with pytest.raises(urllib.error.HTTPError) as err:
            post(wrong)
        assert err.value.code == 401
    assert post(doc["token"]) == (200, {"columns": ["1"], "rows": [[1]]})

    remote = RemoteStore(data_dir)
    with pytest.raises(StoreError, match="HTTP 400"):
        remote.query("SELEC nonsense")
    with pytest.raises(StoreError, match="invalid table name"):
        remote.insert("dlq; DROP TABLE dlq", {"x": [1]})

    ep.stop()
    assert not path.exists() and not endpoint_alive(data_dir)


def test_second_process_on_a_held_directory_gets_store_busy(tmp_path):
    # What chDB really does here (verified): the second process's Session raises
    # RuntimeError "...Error initializing EmbeddedServer..." and the server log
    # says the directory's status file is locked.
    with ChdbStore(tmp_path / "chdb") as s:
        s.migrate()
        code = f"""
from pathlib import Path
from fleetscope.store import open_store, StoreBusyError
try:
    open_store(Path({str(tmp_path)!r}))
    print("OPENED")
except StoreBusyError as exc:
    print("BUSY:", exc)
"""
        proc = run_py(code)
        assert proc.returncode == 0, proc.stderr
        assert "BUSY:" in proc.stdout, proc.stdout
        assert "another fleetscope process" in proc.stdout and "fleetscope up" in proc.stdout


def test_open_store_picks_chdb_without_an_endpoint(tmp_path):
    # A stale endpoint.json (dead pid) must not be trusted.
    (tmp_path / "endpoint.json").write_text(json.dumps({"url": "http://127.0.0.1:9", "token": "t", "pid": 2 ** 22 + 12345}))
    with open_store(tmp_path) as s:
        assert isinstance(s, ChdbStore)
        assert s.query("SELECT 1 + {x:UInt8}", {"x": 1}).rows == [(2,)]


# ---- ClickHouse server store: pure parts only (no server on this machine) ----------

def test_clickhouse_url_credentials(tmp_path):
    c = chs.resolve_connection("http://alice:s%40cret@ch.example:8123/analytics", env={})
    assert (c.dsn, c.interface, c.username, c.password) == ("http://ch.example:8123/analytics", "http", "alice", "s@cret")
    assert "s@cret" not in repr(c)

    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    env = {chs.ENV_USER: "bob", chs.ENV_PASSWORD_FILE: str(secret)}
    c = chs.resolve_connection("https://ch.example", env=env)
    assert (c.dsn, c.interface, c.username, c.password) == ("https://ch.example", "https", "bob", "from-file")
    c = chs.resolve_connection("https://ch.example", env={**env, chs.ENV_PASSWORD: "from-env"})
    assert c.password == "from-env"
    c = chs.resolve_connection("http://carol:urlpw@h:8123", env={**env, chs.ENV_PASSWORD: "from-env"})
    assert (c.username, c.password) == ("carol", "urlpw")

    assert chs.redact("http://alice:hunter2@h:8123/db") == "http://alice:***@h:8123/db"
    for bad in ("chdb:///tmp/x", "ftp://h", "http://"):
        with pytest.raises(StoreError):
            chs.resolve_connection(bad, env={})
    with pytest.raises(StoreError, match="PASSWORD_FILE"):
        chs.resolve_connection("http://h", env={chs.ENV_PASSWORD_FILE: str(tmp_path / "missing")})


def test_clickhouse_value_conversion():
    ns = np.array([1_700_000_000_123_456_789], dtype=np.int64)
    assert chs.to_server_column(Prepared("t", "time", "DateTime64(3, 'UTC')", ns)) == [1_700_000_000_123]
    assert chs.to_server_column(Prepared("t", "time", "DateTime64(9, 'UTC')", ns)) == [1_700_000_000_123_456_789]
    assert chs.to_server_column(Prepared("s", "str", "LowCardinality(String)", StrColumn.of(["b", "a", "b"]))) == ["b", "a", "b"]
    import datetime as dt
    assert chs.jsonable({"k": [float("nan"), np.int64(3), dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)]}) == \
        {"k": [None, 3, "2024-01-01 00:00:00"]}


def test_pyarrow_tables_are_accepted(store):
    # The stream sinks hand the store Arrow tables; maps arrive as (key, value) pairs.
    import pyarrow as pa
    now = np.datetime64(time.time_ns(), "ns")
    table = pa.table({
        "tenant": ["acme"], "job": ["j"], "host": ["h"], "rank": pa.array([3], pa.int32()),
        "window_start": pa.array(np.array([now])), "window_end": pa.array(np.array([now])),
        "feature_version": pa.array([2], pa.uint16()),
        "feature": pa.array([[("a", 1.0), ("b", 2.0)]], pa.map_(pa.string(), pa.float64())),
        "sources": [["cuda"]], "event_count": pa.array([4], pa.uint32()), "emitted_at": pa.array(np.array([now])),
    })
    assert store.insert("features", table, dedupe_token="arrow-1") == 1
    assert store.insert("features", table, dedupe_token="arrow-1") == 1
    assert store.query("SELECT rank, feature, sources FROM features").rows == [(3, {"a": 1, "b": 2}, ["cuda"])]
    # A naive time parameter means UTC, whatever the host's time zone (this fails
    # without the store's session_timezone setting when run with TZ=America/New_York).
    since = str(now - np.timedelta64(1, "s")).replace("T", " ")
    assert store.query("SELECT count() FROM features WHERE window_start >= {s:DateTime64(9)}", {"s": since}).rows == [(1,)]


# ---- the store's modules import one another in one direction (issue 12) -------------

def _store_imports() -> dict[str, set[str]]:
    """store module -> store modules it imports, counting imports inside functions."""
    import ast
    import fleetscope.store as pkg
    folder = Path(pkg.__file__).parent
    modules = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in modules:
        deps = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[:2] == ["fleetscope", "store"]:
                    deps |= {parts[2]} if len(parts) > 2 else {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[2] for a in node.names if a.name.startswith("fleetscope.store.")}
        graph[name] = deps & modules - {name}
    return graph


def test_store_modules_have_no_import_circle_even_through_late_imports():
    graph = _store_imports()
    graph.pop("__init__", None)  # the package's front door imports its modules; none imports it back
    for deps in graph.values():
        deps.discard("__init__")
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for dep in sorted(graph[node]):
            assert state.get(dep) != "open", f"import circle: {' -> '.join(path[path.index(dep):] + [dep])}"
            if dep not in state:
                visit(dep)
        path.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert "migrations" not in graph["base"] and "base" in graph["migrations"]

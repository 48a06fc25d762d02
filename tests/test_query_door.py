"""The query door (issue 13): `fleetscope query` and the endpoint's /query only read.

Everything here runs against the real engine (chDB) in tmp_path, through the
real loopback endpoint, with real sockets; url() is pointed at a real HTTP
server on loopback that counts the requests it gets. No ClickHouse server on
the test machines: ClickHouseServerStore.read_query is not exercised.
"""
from __future__ import annotations

import http.server
import json
import os
import socket
import stat
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fleetscope.store import ChdbStore, QueryEndpoint, RemoteStore, StoreError, open_store
from fleetscope.store.read_only import HARMLESS_TABLE_FUNCTIONS, REACHING_TABLE_FUNCTIONS
from fleetscope.wire import StrColumn


def poll(condition, what: str, deadline_s: float = 60.0, every_s: float = 0.05):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


class CountingHttpServer:
    """A real HTTP server on loopback that counts what it is asked, to see whether url() reached out."""

    def __init__(self):
        self.hits: list[str] = []
        hits = self.hits

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"a\n")

            def log_message(self, *args):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/probe"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def served(tmp_path):
    s = ChdbStore(tmp_path / "chdb")
    s.migrate()
    ep = QueryEndpoint(s, tmp_path).start()
    web = CountingHttpServer()
    yield s, ep, tmp_path, web
    web.close()
    ep.stop()
    s.close()


def refused_cases(tmp: Path, url: str) -> list[str]:
    """What the audit ran through the door (and more of the same kind)."""
    return [
        "SELECT count() FROM file('/etc/passwd', 'LineAsString')",        # read a file (the audit: /etc/shadow)
        f"SELECT * FROM url('{url}', 'LineAsString')",                    # made a request
        f"INSERT INTO FUNCTION file('{tmp}/written.txt', 'LineAsString') SELECT 'x'",  # wrote a file
        f"SELECT 1 INTO OUTFILE '{tmp}/outfile.txt'",                     # readonly=1 still wrote this one
        "SELECT file('/etc/hostname')",                                   # the scalar file(): readonly=1 ran it
        "DESCRIBE file('/etc/passwd', 'LineAsString')",                   # readonly=1 ran it
        "SELECT * FROM `file`('/etc/passwd', 'LineAsString')",
        "SELECT * FROM file/* hidden */('/etc/passwd', 'LineAsString')",
        "SELECT * FROM (SELECT * FROM file('/etc/passwd', 'LineAsString'))",
        "SELECT * FROM filesystem('/etc')",
        "SELECT * FROM remote('127.0.0.1:9000', system.one)",
        "SELECT * FROM remoteSecure('127.0.0.1:9440', system.one)",
        "SELECT * FROM s3('http://127.0.0.1:1/bucket/key', 'CSV')",
        "SELECT * FROM executable('id', 'TSV', 'x String')",
        "SELECT * FROM mysql('127.0.0.1:3306', 'db', 't', 'u', 'p')",
        "SELECT * FROM postgresql('127.0.0.1:5432', 'db', 't', 'u', 'p')",
        "SELECT * FROM hdfs('hdfs://127.0.0.1:9000/x', 'CSV')",
        "SELECT * FROM sqlite('/tmp/x.db', 't')",
        "SELECT * FROM python(x)",
        "CREATE TABLE evil (x UInt8) ENGINE = Memory",
        "DROP TABLE dlq",
        "ALTER TABLE raw_metrics DELETE WHERE 1",
        "TRUNCATE TABLE raw_metrics",
        "INSERT INTO remediation_log (record_id, status, command) VALUES ('forged', 'ok', 'kubectl cordon x')",
        "KILL QUERY WHERE 1",                                             # readonly=1 ran it
        "SELECT 1; DROP TABLE dlq",
        "USE system",                                                     # readonly=1 ran it
        "SET readonly = 0",
        "SELECT 1 SETTINGS max_execution_time = 0",
        "SYSTEM FLUSH LOGS",
        "OPTIMIZE TABLE raw_metrics",
        "SELECT * FROM system.one FORMAT CSV",
        "SELECT $$x$$",
    ]


def side_effects(s: ChdbStore, tmp: Path, web: CountingHttpServer) -> dict:
    return {"files": sorted(p.name for p in tmp.glob("*.txt")), "url_hits": list(web.hits),
            "tables": sorted(r[0] for r in s.query("SHOW TABLES").rows),
            "forged": s.query("SELECT count() FROM remediation_log").rows[0][0],
            "database": s.read_query("SELECT currentDatabase()").rows[0][0]}


def test_the_door_refuses_what_reaches_out_or_writes(served):
    s, ep, tmp, web = served
    before = side_effects(s, tmp, web)
    remote = RemoteStore(tmp)
    for sql in refused_cases(tmp, web.url):
        for door in (s.read_query, remote.query):  # in-process, and another process's way in
            with pytest.raises(StoreError, match="query refused") as err:
                door(sql)
            assert "\n" not in str(err.value).split(" (endpoint")[0], "one line"
    assert side_effects(s, tmp, web) == before
    assert before["files"] == [] and before["url_hits"] == [] and before["forged"] == 0


def test_reads_still_work_through_the_door(served):
    s, ep, tmp, web = served
    s.insert("raw_metrics", {"tenant": ["acme"] * 3, "job": ["j"] * 3, "rank": np.arange(3, dtype=np.int32),
                             "ts": np.full(3, time.time_ns(), dtype=np.int64), "metric": ["m"] * 3,
                             "value": [1.0, 2.0, 3.0], "batch_id": StrColumn.constant("b", 3)}, dedupe_token="r")
    remote = RemoteStore(tmp)
    for door in (s.read_query, remote.query):
        assert door("SELECT sum(value) FROM raw_metrics WHERE tenant = {t:String}", {"t": "acme"}).rows == [(6.0,)]
        assert door("WITH 2 AS x SELECT x * {y:UInt8}", {"y": 3}).rows == [(6,)]
        assert door("(SELECT count() FROM numbers(10));").rows == [(10,)]
        assert door("SELECT format('{} {}', 'a', 'b')").rows == [("a b",)]
        assert "raw_metrics" in {r[0] for r in door("SHOW TABLES").rows}
        assert door("DESCRIBE TABLE raw_metrics").rows and door("EXPLAIN SELECT 1").rows
        assert door("EXISTS TABLE raw_metrics").rows == [(1,)]
        assert door("SELECT 'file(''/etc/passwd'')' AS s -- file('x') in a comment").rows == [("file('/etc/passwd')",)]
        # The engine's own read-only mode and time limit are on underneath the guard.
        assert door("SELECT getSetting('readonly'), getSetting('max_execution_time')").rows == [(1, 60)]


def test_every_table_function_the_engine_knows_is_classified(store):
    known = {r[0].lower() for r in store.query("SELECT name FROM system.table_functions").rows}
    unclassified = known - HARMLESS_TABLE_FUNCTIONS - REACHING_TABLE_FUNCTIONS
    assert unclassified == set(), f"review these table functions for read_only.py: {sorted(unclassified)}"
    assert {"file", "url", "remote", "s3", "executable", "python"} <= REACHING_TABLE_FUNCTIONS


def test_cli_query_is_read_only(tmp_path, monkeypatch, capsys):
    from fleetscope.cli.main import main
    monkeypatch.delenv("FLEETSCOPE_CONFIG", raising=False)
    monkeypatch.setenv("FLEETSCOPE_DATA_DIR", str(tmp_path))
    assert main(["db", "migrate"]) == 0
    assert main(["query", "SELECT count() FROM file('/etc/passwd', 'LineAsString')"]) == 1
    err = capsys.readouterr().err
    assert "query refused: file() reaches files" in err and "passwd" not in capsys.readouterr().out
    assert main(["query", "DROP TABLE dlq"]) == 1 and "DROP statements are not allowed" in capsys.readouterr().err
    assert main(["query", "SELECT count() AS n FROM dlq", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": 0}]


def test_a_query_stops_at_its_time_limit_and_the_next_read_is_its_own(tmp_path):
    with ChdbStore(tmp_path / "chdb", read_timeout_s=1) as s:
        with pytest.raises(StoreError, match="TIMEOUT_EXCEEDED|Timeout exceeded"):
            s.read_query("SELECT count() FROM numbers(1000000000000) WHERE sipHash64(number) = 1")
        # chDB returns the stopped query's leftovers as the next result on that session;
        # the reader opens a fresh one instead.
        assert s.read_query("SELECT 2 AS two").as_dicts() == [{"two": 2}]
        assert s.read_query("SELECT getSetting('max_execution_time')").rows == [(1,)]


LONG_READ = ("SELECT sleepEachRow(0.5) FROM numbers(6) UNION ALL SELECT sleepEachRow(0.5) FROM numbers(6) "
             "UNION ALL SELECT sleepEachRow(0.5) FROM numbers(6) /* fs-long-read */")
RUNNING = ("SELECT count() FROM system.processes WHERE query LIKE '%fs-long-read%' "
           "AND query NOT LIKE '%system.processes%' AND query NOT LIKE '%KILL%'")


def test_a_long_read_does_not_hold_up_inserts(served):
    # The audit: a 3 s query through the endpoint held the store lock for 2.74 s of an insert.
    s, ep, tmp, web = served
    outcome: dict = {}

    def long_read():
        try:
            outcome["rows"] = RemoteStore(tmp).query(LONG_READ).rows
        except StoreError as exc:
            outcome["error"] = str(exc)

    reader = threading.Thread(target=long_read)
    reader.start()
    poll(lambda: s.query(RUNNING).rows[0][0] > 0, "the long read to start", deadline_s=30)
    n = s.insert("dlq", {"topic": ["t"], "reason": ["r"], "ts": np.array([time.time_ns()], dtype=np.int64)},
                 dedupe_token="during-read")
    still_running = s.query(RUNNING).rows[0][0]
    s.query("KILL QUERY WHERE query LIKE '%fs-long-read%' AND query NOT LIKE '%KILL%' SYNC")
    reader.join(timeout=60)
    assert n == 1 and still_running == 1, "the insert had to wait for the read"


# ---- the endpoint's limits, with raw sockets ----------------------------------------

def _connect(ep: QueryEndpoint) -> socket.socket:
    host, port = ep._server.server_address[:2]
    sock = socket.create_connection((host, port), timeout=30)
    return sock


def _request(ep: QueryEndpoint, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send raw bytes; return (status, everything the server sent until it closed or 30 s passed)."""
    with _connect(ep) as sock:
        sock.sendall(head.encode() + body)
        got = b""
        try:
            while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < _content_length(got):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                got += chunk
        except socket.timeout:
            pytest.fail(f"no answer within 30 s; got {got[:200]!r}")
    return int(got.split(b" ", 2)[1]), got


def _content_length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def _post_head(ep: QueryEndpoint, path: str, extra: str, token: bool = True) -> str:
    auth = f"Authorization: Bearer {ep.token}\r\n" if token else ""
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}{extra}\r\n"


def test_the_endpoint_checks_content_length_before_reading(served):
    s, ep, tmp, web = served
    # The audit: a body of 512 MiB was read into memory. Now the size is refused from the header.
    code, raw = _request(ep, _post_head(ep, "/query", f"Content-Length: {100 << 20}\r\n"))
    assert code == 413 and b"exceeds" in raw
    code, raw = _request(ep, _post_head(ep, "/query", ""))
    assert code == 411 and b"Content-Length" in raw
    code, raw = _request(ep, _post_head(ep, "/query", "Content-Length: -5\r\n"))
    assert code == 400 and b"not a byte count" in raw
    code, raw = _request(ep, _post_head(ep, "/query", "Transfer-Encoding: chunked\r\n"), b"5\r\nhello\r\n0\r\n\r\n")
    assert code == 411
    code, raw = _request(ep, _post_head(ep, "/query", f"Content-Length: {100 << 20}\r\n", token=False))
    assert code == 401  # the token is checked before the size, and nothing is read
    body = json.dumps({"sql": "SELECT 1"}).encode()
    code, raw = _request(ep, _post_head(ep, "/query", f"Content-Length: {len(body)}\r\n"), body)
    assert code == 200 and raw.endswith(b'{"columns": ["1"], "rows": [[1]]}')


def test_a_stalled_or_idle_connection_is_closed(tmp_path):
    with ChdbStore(tmp_path / "chdb") as s:
        ep = QueryEndpoint(s, tmp_path, socket_timeout_s=0.5).start()
        try:
            # Half a body, then nothing: 408 once the socket times out.
            code, raw = _request(ep, _post_head(ep, "/query", "Content-Length: 100\r\n"), b'{"sql": ')
            assert code == 408
            # A connection that never sends a request line is closed by the server.
            with _connect(ep) as idle:
                assert poll(lambda: idle.recv(1) == b"", "the idle connection to be closed", deadline_s=30)
        finally:
            ep.stop()


def test_connections_are_bounded(served):
    # The audit: 200 idle connections without a token held 203 threads.
    s, ep, tmp, web = served
    threads_before = threading.active_count()
    socks = [_connect(ep) for _ in range(100)]
    most_threads = threading.active_count() - threads_before
    try:
        def answers() -> list[bytes | None]:
            """Per socket: the first bytes the server sent, b"" once it closed, None while it waits."""
            out = []
            for sock in socks:
                sock.setblocking(False)
                try:
                    out.append(sock.recv(64, socket.MSG_PEEK))
                except BlockingIOError:
                    out.append(None)
            return out

        def all_answered() -> list[bytes] | None:
            nonlocal most_threads
            most_threads = max(most_threads, threading.active_count() - threads_before)
            got = answers()
            return got if None not in got else None

        # Over the bound: 503 at once. Within it: idle connections closed after the socket timeout.
        got = poll(all_answered, "every connection to get 503 or be closed", deadline_s=90)
        busy = sum(g.startswith(b"HTTP/1.1 503") for g in got)
        assert busy + got.count(b"") == 100 and busy >= 100 - 2 * ep.max_connections
        assert ep.refused_connections == busy
        assert most_threads <= ep.max_connections
    finally:
        for sock in socks:
            sock.close()
    # Once they are gone, the endpoint serves again.
    poll(lambda: _try_query(tmp), "the endpoint to serve again", deadline_s=60)


def _try_query(tmp: Path) -> bool:
    try:
        return RemoteStore(tmp).query("SELECT 1").rows == [(1,)]
    except StoreError:
        return False


# ---- the data directory is private ------------------------------------------------

def test_the_data_directory_and_its_files_are_private(tmp_path):
    # The audit: 0755 directories and 0644 files under umask 022.
    data = tmp_path / "data"
    old = os.umask(0o022)
    try:
        with open_store(data, prefer_endpoint=False) as s:
            s.migrate()
            s.insert("dlq", {"topic": ["t"], "reason": ["r"], "ts": np.array([time.time_ns()], dtype=np.int64)},
                     dedupe_token="perm")
            ep = QueryEndpoint(s, data).start()
            ep.stop()
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
        assert stat.S_IMODE((data / "chdb").stat().st_mode) == 0o700
        readable = [f"{oct(stat.S_IMODE(p.lstat().st_mode))} {p.relative_to(data)}" for p in data.rglob("*")
                    if not p.is_symlink() and stat.S_IMODE(p.lstat().st_mode) & 0o077]
        assert readable == []
    finally:
        os.umask(old)


def test_an_existing_world_readable_store_directory_is_made_private(tmp_path):
    (tmp_path / "chdb").mkdir(mode=0o755)
    os.chmod(tmp_path / "chdb", 0o755)
    with ChdbStore(tmp_path / "chdb"):
        pass
    assert stat.S_IMODE((tmp_path / "chdb").stat().st_mode) == 0o700


# ---- the server backend: no ClickHouse server here, so a recording stand-in client ----

class RecordingClickHouseClient:
    """Stands in for clickhouse-connect's client (no ClickHouse server on the test machines):
    records each query and its settings, answers getSetting('readonly') with `profile_readonly`."""

    def __init__(self, profile_readonly: int):
        self.profile_readonly, self.calls = profile_readonly, []

    def query(self, sql, parameters=None, settings=None):
        self.calls.append((sql, settings))
        rows = [(self.profile_readonly,)] if "getSetting('readonly')" in sql else [(1,)]
        return type("Result", (), {"column_names": ("x",), "result_rows": rows})()


def _server_store(profile_readonly: int):
    from fleetscope.store.clickhouse_store import ClickHouseServerStore
    store = object.__new__(ClickHouseServerStore)  # skip connecting: there is no server
    store.database, store.read_timeout_s, store._profile_readonly = "fleetscope", 60, None
    store._client = RecordingClickHouseClient(profile_readonly)
    return store


def test_server_reads_go_read_only_and_time_bounded():
    store = _server_store(profile_readonly=0)
    with pytest.raises(StoreError, match="query refused: file"):
        store.read_query("SELECT * FROM file('/etc/passwd', 'LineAsString')")
    assert store._client.calls == []  # refused before the server saw it
    assert store.read_query("SELECT 1").rows == [(1,)]
    assert store._client.calls[-1] == ("SELECT 1", {"readonly": 2, "max_execution_time": 60})
    tenant = _server_store(profile_readonly=1)  # a tenant's user may not send settings at all
    tenant.read_query("SELECT 1")
    assert tenant._client.calls[-1] == ("SELECT 1", None)

"""A loopback HTTP endpoint so other processes can use the one process's chDB.

chDB opens a data directory in one process at a time. While `fleetscope up`
holds it, `fleetscope query` from another terminal must go through that
process: the holder runs QueryEndpoint, which writes data_dir/endpoint.json
(url, bearer token, pid; mode 0600 so only this user can read the token),
and other processes use RemoteStore, which speaks this protocol:

    POST /query   {"sql", "params"}                       -> {"columns", "rows"}
    POST /insert  {"table", "columns": {name: list}, "dedupe_token"} -> {"rows": n}
    POST /migrate                                          -> {"applied": [...]}
    GET  /health                                           -> {"ok": true, "pid", "database"}
    GET  /stats                                            -> stats_provider()
    errors: {"error": message} with 400 (bad request or store error), 401, 404,
            408 (body too slow), 411 (no Content-Length), 413 (body too large),
            500, 503 (too many connections)

/query is the query door: store.read_query, read-only and time-bounded (see
read_only.py). Writes go only through the store's own insert and migrate
methods (/insert, /migrate), never through SQL.

Every request needs `Authorization: Bearer <token>`; it is checked before any
body is read. Loopback only: the token travels in clear HTTP, so the endpoint
refuses any other bind address. Bounded, so that a client (or many) cannot
exhaust the holder: at most max_connections connections at once (the rest get
503 at once), socket_timeout_s for each read and write on a connection (an idle
keep-alive connection is closed after it), and a body size limit per route,
checked from Content-Length before anything is read.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
import socket
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

from fleetscope.store.base import ColumnData, QueryResult, Store, StoreError, as_list, columns_of
from fleetscope.store.read_only import READ_TIMEOUT_S

ENDPOINT_FILE = "endpoint.json"
MAX_CONNECTIONS = 16          # the holder's threads for the endpoint; far above one user's terminals
SOCKET_TIMEOUT_S = 10.0       # per read/write on a connection, and how long an idle one is kept
BODY_LIMITS = {               # bytes, per route
    "/query": 1 << 20,        # SQL and its parameters
    "/insert": 64 << 20,      # one insert batch; a remediation log row is a few KiB
    "/migrate": 1 << 10,      # an empty object
}


class QueryEndpoint:
    def __init__(self, store: Store, data_dir: Path, host: str = "127.0.0.1", port: int = 0,
                 stats_provider: Callable[[], dict] | None = None, max_connections: int = MAX_CONNECTIONS,
                 socket_timeout_s: float = SOCKET_TIMEOUT_S) -> None:
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"the query endpoint binds to loopback only, not {host!r}")
        if max_connections < 1 or not socket_timeout_s > 0:
            raise ValueError("max_connections must be >= 1 and socket_timeout_s > 0")
        self.store, self.data_dir = store, Path(data_dir)
        self.host, self.port = host, port
        self.stats_provider = stats_provider
        self.max_connections, self.socket_timeout_s = max_connections, socket_timeout_s
        self.token = secrets.token_urlsafe(32)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise StoreError("the endpoint is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"

    @property
    def path(self) -> Path:
        return self.data_dir / ENDPOINT_FILE

    @property
    def refused_connections(self) -> int:
        """Connections answered 503 because max_connections were open."""
        return self._server.refused if self._server is not None else 0

    def start(self) -> "QueryEndpoint":
        server_cls = _BoundedV6Server if ":" in self.host else _BoundedServer
        self._server = server_cls((self.host, self.port), _handler_for(self), self.max_connections)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fleetscope-endpoint", daemon=True)
        self._thread.start()
        self._write_file()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._remove_file()
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    def _write_file(self) -> None:
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        doc = {"url": self.url, "token": self.token, "pid": os.getpid(), "database": self.store.database}
        tmp = self.path.with_name(f".{ENDPOINT_FILE}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        # Created 0600 from the start (O_EXCL, no window where the token is world-readable),
        # then renamed so readers never see a half-written file.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)

    def _remove_file(self) -> None:
        try:  # only our own file: a newer holder may have replaced it
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()
        except (OSError, ValueError):
            pass


_BUSY = json.dumps({"error": "too many open connections to the fleetscope endpoint; try again"}).encode()
_BUSY_REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Content-Length: " + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY)


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` at once; the next gets 503 and is closed."""
    daemon_threads = True
    request_queue_size = 128  # the listen backlog: over-the-bound clients get their 503 at once, not SYN retries

    def __init__(self, address, handler, max_connections: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            try:  # a few bytes into a fresh socket's buffer: never blocks the accepting thread
                request.setblocking(False)
                request.send(_BUSY_REPLY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _BoundedV6Server(_BoundedServer):
    address_family = socket.AF_INET6


class _HttpError(Exception):
    """A request the endpoint answers with `code` and then closes the connection."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _handler_for(ep: QueryEndpoint):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = ep.socket_timeout_s  # StreamRequestHandler sets it on the socket

        def log_message(self, *args) -> None:  # the lead's live status owns the terminal
            pass

        def _reply(self, code: int, doc: Any) -> None:
            body = json.dumps(doc).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
            except OSError:  # the client went away or stopped reading: nothing left to tell it
                self.close_connection = True

        def _authorised(self) -> bool:
            got = self.headers.get("Authorization", "")
            if hmac.compare_digest(got.encode(), f"Bearer {ep.token}".encode()):
                return True
            self.close_connection = True  # its body, if any, stays unread
            self._reply(401, {"error": "missing or wrong bearer token (see endpoint.json)"})
            return False

        def _body(self) -> dict:
            limit = BODY_LIMITS[self.path]
            if self.headers.get("Transfer-Encoding"):
                raise _HttpError(411, "send the body with a Content-Length, not a Transfer-Encoding")
            declared = self.headers.get("Content-Length")
            if declared is None:
                raise _HttpError(411, "a POST needs a Content-Length header")
            if not declared.strip().isdigit():
                raise _HttpError(400, f"Content-Length {declared!r} is not a byte count")
            length = int(declared)
            if length > limit:
                raise _HttpError(413, f"body of {length} bytes exceeds {limit} for {self.path}")
            try:
                raw = self.rfile.read(length)
            except OSError:  # socket timeout: a client that stalls mid-body
                raise _HttpError(408, f"the body did not arrive within {ep.socket_timeout_s:g} s") from None
            if len(raw) != length:
                raise _HttpError(400, f"body ended after {len(raw)} of {length} bytes")
            try:
                doc = json.loads(raw or b"{}")
            except ValueError as exc:
                raise _BadRequest(f"body is not JSON: {exc}") from None
            if not isinstance(doc, dict):
                raise _BadRequest("body must be a JSON object")
            return doc

        def _dispatch(self, routes: dict[str, Callable[[], Any]]) -> None:
            if not self._authorised():
                return
            route = routes.get(self.path)
            if route is None:
                self.close_connection = True
                self._reply(404, {"error": f"no route {self.command} {self.path}"})
                return
            try:
                self._reply(200, route())
            except _HttpError as exc:
                self.close_connection = True  # the body may be unread: the connection cannot carry on
                self._reply(exc.code, {"error": str(exc)})
            except (StoreError, _BadRequest, ValueError, TypeError, KeyError) as exc:
                self._reply(400, {"error": str(exc) or type(exc).__name__})
            except Exception as exc:  # the endpoint must outlive a bad request
                self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})

        def do_GET(self) -> None:
            self._dispatch({
                "/health": lambda: {"ok": True, "pid": os.getpid(), "database": ep.store.database},
                "/stats": lambda: ep.stats_provider() if ep.stats_provider else {},
            })

        def do_POST(self) -> None:
            def query():
                doc = self._body()
                params = doc.get("params") or None
                if params is not None and not isinstance(params, dict):
                    raise _BadRequest("field 'params' must be a dict")
                res = ep.store.read_query(_require(doc, "sql", str), params)
                return {"columns": res.columns, "rows": res.rows}

            def insert():
                doc = self._body()
                columns = _require(doc, "columns", dict)
                n = ep.store.insert(_require(doc, "table", str), columns, doc.get("dedupe_token"))
                return {"rows": n}

            def migrate():
                self._body()  # drain it, keep-alive needs that
                return {"applied": ep.store.migrate()}

            self._dispatch({"/query": query, "/insert": insert, "/migrate": migrate})

    return Handler


class _BadRequest(Exception):
    pass


def _require(doc: dict, key: str, kind: type):
    if not isinstance(doc.get(key), kind):
        raise _BadRequest(f"field {key!r} must be a {kind.__name__}")
    return doc[key]


# ---- the client side -----------------------------------------------------------

def read_endpoint(data_dir: Path) -> dict | None:
    """endpoint.json if present, well-formed and written by a live process."""
    try:
        doc = json.loads((Path(data_dir) / ENDPOINT_FILE).read_text())
        url, token, pid = doc["url"], doc["token"], int(doc["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(url, str) and isinstance(token, str) and _pid_alive(pid)):
        return None
    return doc


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def endpoint_alive(data_dir: Path, timeout: float = 2.0) -> bool:
    """True when endpoint.json names a live process that answers /health."""
    doc = read_endpoint(data_dir)
    if doc is None:
        return False
    try:
        _call(doc["url"], doc["token"], "GET", "/health", None, timeout)
        return True
    except StoreError:
        return False


def _call(url: str, token: str, method: str, path: str, body: dict | None, timeout: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", exc.reason)
        except ValueError:
            message = exc.reason
        raise StoreError(f"{message} (endpoint {url}{path}: HTTP {exc.code})") from None
    except (urllib.error.URLError, OSError) as exc:
        raise StoreError(f"the fleetscope endpoint at {url} did not answer: {exc}") from None


class RemoteStore(Store):
    """The store of the process that holds chDB, reached through its endpoint."""

    def __init__(self, data_dir: Path, timeout: float = READ_TIMEOUT_S + 15.0) -> None:
        doc = read_endpoint(data_dir)
        if doc is None:
            raise StoreError(f"no live fleetscope endpoint in {data_dir} (is `fleetscope up` running?)")
        self.url, self._token, self.pid = doc["url"], doc["token"], int(doc["pid"])
        self.database = doc.get("database", "fleetscope")
        self.timeout = timeout

    def _post(self, path: str, body: dict) -> Any:
        return _call(self.url, self._token, "POST", path, body, self.timeout)

    def migrate(self) -> list[str]:
        return list(self._post("/migrate", {})["applied"])

    def insert(self, table: str, columns: dict[str, ColumnData], dedupe_token: str | None = None) -> int:
        body = {"table": table, "columns": {k: as_list(v) for k, v in columns_of(columns).items()},
                "dedupe_token": dedupe_token}
        return int(self._post("/insert", body)["rows"])

    def read_query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        doc = self._post("/query", {"sql": sql, "params": params or {}})
        return QueryResult(list(doc["columns"]), [tuple(r) for r in doc["rows"]])

    def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        """Through another process, every query goes through its door: read-only."""
        return self.read_query(sql, params)

    def stats(self) -> dict:
        return _call(self.url, self._token, "GET", "/stats", None, self.timeout)

    def close(self) -> None:
        pass  # nothing held: each call is its own HTTP request

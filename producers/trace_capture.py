"""Capture around anomalies: the agent's last `trace_capture_s` seconds of per-call records, and on an anomaly of
a rank it hosts, that rank's window of them on `<prefix>.traces` (fleetscope/trace_message.py).

- CallRing holds the calls, bounded by age (trace_capture_s) and by count (trace_capture_max_records: past it
  the oldest are dropped and counted). Each call is filed under its process's (tenant, job, rank), resolved
  when it arrives (a process may be gone when its anomaly comes); calls of processes without a rank are not
  kept, since no anomaly can name them. A process's last known identity is kept as long as its calls may be
  (the resolver forgets a process once it exits, and the last calls of one that just died are the ones an
  anomaly most wants).
- The records come from the CUDA, NCCL, torch and Python tracers in detail mode (on while trace_capture_s > 0):
  the tracer manager hands each sampled tracer's records to `add_records` on the agent's tick.
- A listener thread reads `<prefix>.anomalies` from its partitions' ends (no consumer group offsets: anomalies
  from before the agent started have no records here). An anomaly whose host is this agent's is captured once
  its window's end plus the margin (one window) and the settle time (two sample intervals) have passed and every
  detail tracer has been drained past that time (`drained`, from the tracer manager after each tick): a tick
  that runs late or a tracer sampled on a later tick (busy attaching) must not leave a span's last calls out.
  A span whose tracers lag that long is captured anyway before its start leaves the ring (at three quarters of
  the keep time after its start), and counted (`capture_published_early`: its last calls may be missing).
- The same listener reads live capture requests on `<prefix>.control` (fleetscope/capture_request.py, from
  `fleetscope trace --live`), also from the ends. A valid one, checked against `trace_request_max_s`, is cut
  into pieces of at most half the ring's keep time (so the ring still holds a piece when it is due); each is
  due as an anomaly's span is, and then each rank of the job this host holds calls of in that piece
  gets a `<prefix>.traces` capture exactly like an anomaly's (window_start_ns/window_end_ns = the piece). A
  job without ranks here publishes nothing. Each piece carries the request's `request_id` (captures around
  anomalies carry none), so the store can tell which request a capture answered. Invalid requests are logged
  and counted (`capture_requests_invalid`), valid ones counted (`capture_requests`).
- Detail mode is compiled into the tracers' BPF (DETAIL) while trace_capture_s > 0, behind a runtime gate (a
  CLOCK_MONOTONIC deadline in a BPF array, bpf/gpu_calls.bpf.c): records are sent only while it is open.
  With trace_capture_anomalies (the default) the tracers open it for the whole run at their start, and
  anomalies are captured as above. Without, it starts closed, an anomaly of a rank here is counted
  (`capture_anomalies_ignored`) and not captured, and each valid live request opens it through `open_detail`
  (wired by attach_capture to the trace source, which hands it to the tracer manager) from its arrival until
  its end plus the settle time; of several requests the latest end wins. Openings are counted
  (`capture_detail_opened`). The gate is one per tracer, not per process: a request opens it for every
  process traced here, though only the job's calls are published. An agent with trace_capture_s = 0 has no
  detail mode and no listener, and answers no request.
- Nothing here may harm the agent: every failure is logged and counted (`capture_errors`,
  `capture_publish_errors`), never raised into the tick.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque

from fleetscope.capture_request import CaptureRequest, CaptureRequestError, parse_request
from fleetscope.kafka_settings import client_conf
from fleetscope.trace_message import TRACE_SCHEMA, call_of, trace_messages
from fleetscope.producers.tracers.rows import LastKnownIdentities

log = logging.getLogger(__name__)
ANOMALY_SCHEMA = "anomaly/1"  # the fs-schema of <prefix>.anomalies (streams/derived_codec.py)
SEEN_MAX = 4096  # anomalies and requests remembered, so a replayed one is not captured twice
REQUESTS_MAX = 64  # live requests in progress at once; more are refused (counted invalid)


class CallRing:
    """Calls by (tenant, job, rank), the newest `keep_s` seconds of them, at most `max_records`."""

    def __init__(self, keep_s: float, max_records: int, clock_ns=time.time_ns):
        self.keep_ns = int(keep_s * 1e9)
        self.max_records = max_records
        self.clock_ns = clock_ns
        self._calls: deque = deque()  # (ts_ns, key, call), in arrival order
        self._lock = threading.Lock()  # the tick adds, the listener reads
        self.added = self.expired = self.dropped = 0

    def add(self, key: tuple, calls: list[dict]) -> None:
        with self._lock:
            self._calls.extend((c["ts_ns"], key, c) for c in calls)
            self.added += len(calls)
            over = len(self._calls) - self.max_records
            for _ in range(max(over, 0)):
                self._calls.popleft()
            self.dropped += max(over, 0)
            self._expire()

    def _expire(self) -> None:
        cutoff = self.clock_ns() - self.keep_ns
        while self._calls and self._calls[0][0] < cutoff:
            self._calls.popleft()
            self.expired += 1

    def window(self, key: tuple, from_ns: int, to_ns: int) -> list[dict]:
        """The calls of `key` that start in [from_ns, to_ns], by start time."""
        return self.windows(key.__eq__, from_ns, to_ns).get(key, [])

    def windows(self, match, from_ns: int, to_ns: int) -> dict[tuple, list[dict]]:
        """The calls that start in [from_ns, to_ns] of every key for which `match(key)` holds, by key and start."""
        with self._lock:
            self._expire()
            found: dict[tuple, list[dict]] = {}
            for ts, k, c in self._calls:
                if from_ns <= ts <= to_ns and match(k):
                    found.setdefault(k, []).append(c)
        return {k: sorted(calls, key=lambda c: c["ts_ns"]) for k, calls in found.items()}

    def __len__(self) -> int:
        return len(self._calls)


class TraceCapture:
    """The agent-side capture: a Source for its stats (sample() publishes nothing) and a listener thread."""

    name = "capture"

    def __init__(self, cfg, bootstrap: str, resolver=None, clock_ns=time.time_ns):
        from confluent_kafka import Consumer, Producer
        self.cfg = cfg
        self.resolver = resolver
        self.clock_ns = clock_ns
        self.ring = CallRing(cfg.trace_capture_s, cfg.trace_capture_max_records, clock_ns)
        self.margin_ns = int(cfg.window_s * 1e9)
        self.window_ns = int(cfg.window_s * 1e9)
        self.settle_ns = int(2 * cfg.sample_interval_s * 1e9)  # the tick after the span's end, or the one after
        self.piece_ns = max(self.ring.keep_ns // 2, 1)  # a live request's pieces: the ring still holds one when due
        self.drained_ns = 0  # wall ns before which every detail tracer's ended calls have reached add_records
        self.topic_in, self.topic_out = cfg.topic("anomalies"), cfg.topic("traces")
        self.topic_control = cfg.topic("control")
        self.consumer = Consumer(client_conf(cfg, bootstrap, **{
            "group.id": f"{cfg.consumer_group}-capture-{cfg.host}", "enable.auto.commit": False,
            "fetch.wait.max.ms": 100, "client.id": "fleetscope-capture"}))
        self.producer = Producer(client_conf(cfg, bootstrap, **{
            "acks": "all", "client.id": "fleetscope-capture", "message.max.bytes": cfg.kafka_message_max_bytes}))
        self.ready = threading.Event()  # set once the listener reads the anomalies and control topics from their ends
        self._stop = threading.Event()
        self._pending: list[tuple[tuple, dict]] = []  # (key, head) of anomalies to capture
        self._requests: list[list] = []  # [next piece's start ns, request] of live requests in progress
        self._seen: OrderedDict = OrderedDict()
        self._identities = LastKnownIdentities(self.resolver, cfg.host)  # a gone rank's calls keep its key
        self._thread = threading.Thread(target=self._listen, name="trace-capture", daemon=True)
        self.unranked = self.anomalies = self.published = self.calls_published = self.empty = 0
        self.errors = self.publish_errors = 0
        self.requests = self.requests_invalid = self.request_pieces = 0
        self.anomalies_ignored = self.detail_opened = self.published_early = 0
        # Without trace_capture_anomalies: called with a live request's end (wall ns) plus the settle time, to open
        # the tracers' detail gate until then (TracingSource.open_detail); set by attach_capture.
        self.open_detail = None

    def start(self) -> "TraceCapture":
        self._thread.start()
        return self

    # ---- the tick's side ---------------------------------------------------------------------------------
    def add_records(self, source: str, records: list[dict]) -> None:
        """A tracer's detail records of one sample; never raises."""
        try:
            by_pid: dict[int, list[dict]] = {}
            for r in records:
                by_pid.setdefault(int(r["pid"]), []).append(r)
            now = self.clock_ns()
            for pid, recs in by_pid.items():
                key = self._key_of(pid, now)
                if key is None:
                    self.unranked += len(recs)
                    continue
                self.ring.add(key, [call_of(r, source) for r in recs])
            self._identities.expire(now - self.ring.keep_ns)
        except Exception:
            self._failed("keeping the records of %s", source)

    def drained(self, through_ns: int) -> None:
        """Every detail tracer was sampled at wall ns `through_ns` or later: the calls that ended before it are
        in the ring (the tracer manager, after each tick). Never raises."""
        self.drained_ns = max(self.drained_ns, int(through_ns))

    def _key_of(self, pid: int, now: int) -> tuple | None:
        who = self._identities.resolve(pid, now)  # gone: its last known identity, if any
        return (who.tenant, who.job, who.rank) if who.rank >= 0 else None

    def sample(self, now_ns: int) -> None:
        return None

    def stats(self) -> dict:
        return {"capture_records": len(self.ring), "capture_added": self.ring.added,
                "capture_expired": self.ring.expired, "capture_dropped": self.ring.dropped,
                "capture_unranked": self.unranked, "capture_anomalies": self.anomalies,
                "capture_published": self.published, "capture_calls_published": self.calls_published,
                "capture_empty": self.empty, "capture_errors": self.errors,
                "capture_publish_errors": self.publish_errors, "capture_requests": self.requests,
                "capture_requests_invalid": self.requests_invalid, "capture_request_pieces": self.request_pieces,
                "capture_anomalies_ignored": self.anomalies_ignored, "capture_detail_opened": self.detail_opened,
                "capture_published_early": self.published_early}

    # ---- the listener ------------------------------------------------------------------------------------
    def _listen(self) -> None:
        while not self._stop.is_set() and not self.ready.is_set():
            try:
                self._assign_at_ends()
            except Exception:
                self._failed("reading %s", self.topic_in)
                self._stop.wait(2.0)
        while not self._stop.is_set():
            try:
                msg = self.consumer.poll(0.2)
                if msg is not None and msg.error() is None:
                    if msg.topic() == self.topic_control:
                        self.on_request(msg.value(), dict(msg.headers() or ()))
                    else:
                        self.on_anomaly(msg.value(), dict(msg.headers() or ()))
                self.capture_due()
                self.producer.poll(0)
            except Exception:
                self._failed("handling %s", self.topic_in)
                self._stop.wait(0.5)

    def _assign_at_ends(self) -> None:
        from confluent_kafka import TopicPartition
        parts = []
        for topic in (self.topic_in, self.topic_control):
            meta = self.consumer.list_topics(topic, timeout=5.0).topics.get(topic)
            if meta is None or meta.error is not None or not meta.partitions:
                raise RuntimeError(f"topic {topic} is not there yet")
            for p in sorted(meta.partitions):
                _, high = self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5.0)
                parts.append(TopicPartition(topic, p, high))
        self.consumer.assign(parts)
        self.ready.set()

    def on_anomaly(self, value: bytes, headers: dict) -> None:
        schema = headers.get("fs-schema")
        schema = schema.decode() if isinstance(schema, (bytes, bytearray)) else schema
        if schema != ANOMALY_SCHEMA:
            raise ValueError(f"an anomaly with fs-schema {schema!r}, expected {ANOMALY_SCHEMA!r}")
        a = json.loads(value)
        if a["host"] != self.cfg.host:
            return  # another node's rank
        if not self.cfg.trace_capture_anomalies:
            self.anomalies_ignored += 1
            if self.anomalies_ignored == 1:
                log.info("an anomaly of %s rank %s here is not captured: trace_capture_anomalies is off, so the "
                         "tracers record calls only during live capture requests (counted in "
                         "capture_anomalies_ignored)", a["job"], a["rank"])
            return
        key = (a["tenant"], a["job"], int(a["rank"]))
        start = int(a["window_start_ns"])
        if not self._remember((key, start)):
            return
        self.anomalies += 1
        end = start + self.window_ns
        head = {"tenant": key[0], "job": key[1], "host": self.cfg.host, "rank": key[2], "window_start_ns": start,
                "window_end_ns": end, "from_ns": start - self.margin_ns, "to_ns": end + self.margin_ns}
        self._pending.append((key, head))

    def _remember(self, seen) -> bool:
        """False if `seen` was handled already (a replay); else remember it (the newest SEEN_MAX)."""
        if seen in self._seen:
            return False
        self._seen[seen] = None
        if len(self._seen) > SEEN_MAX:
            self._seen.popitem(last=False)
        return True

    def on_request(self, value: bytes, headers: dict) -> None:
        """A live capture request: scheduled piece by piece if valid, else logged and counted; never raises."""
        try:
            req = parse_request(value, headers, self.cfg.trace_request_max_s)
            if len(self._requests) >= REQUESTS_MAX:
                raise CaptureRequestError(f"{REQUESTS_MAX} requests are in progress already")
        except CaptureRequestError as exc:
            self.requests_invalid += 1
            if self.requests_invalid <= 3 or self.requests_invalid % 100 == 0:
                log.warning("an invalid capture request on %s: %s (%d so far)", self.topic_control, exc,
                            self.requests_invalid)
            return
        if not self._remember(("request", req.request_id)):
            return
        self.requests += 1
        self._requests.append([req.from_ns, req])
        if self.open_detail is not None:
            try:
                self.open_detail(req.to_ns + self.settle_ns)  # calls returning just after the end still count
                self.detail_opened += 1
            except Exception:
                self._failed("opening the tracers' detail records for request %s", req.request_id)
        log.info("capture request %s: job %s%s over %.1f s; ranks here now: %s", req.request_id, req.job,
                 "" if req.rank < 0 else f" rank {req.rank}", (req.to_ns - req.from_ns) / 1e9,
                 sorted({k[2] for k in self._known_keys() if req.matches(k)}) or "none")

    def _known_keys(self) -> set[tuple]:
        return {(who.tenant, who.job, who.rank) for who in self._identities.known() if who.rank >= 0}

    def _due(self, from_ns: int, to_ns: int, now: int) -> bool:
        """Whether the span [from_ns, to_ns] is captured now: its end plus the settle time has passed and every
        detail tracer was drained past it, or, with a tracer lagging, its start is about to leave the ring
        (counted: its last calls may be missing)."""
        settled = to_ns + self.settle_ns
        if now < settled:
            return False
        if self.drained_ns >= settled:
            return True
        if now >= from_ns + self.ring.keep_ns * 3 // 4:
            self.published_early += 1
            if self.published_early <= 3 or self.published_early % 100 == 0:
                log.warning("capturing [%d, %d] before every tracer was sampled past its end (the tracers are "
                            "drained up to %d): its last calls may be missing (%d such so far)", from_ns, to_ns,
                            self.drained_ns, self.published_early)
            return True
        return False

    def capture_due(self, force: bool = False) -> None:
        now = self.clock_ns()
        due, waiting = [], []
        for p in self._pending:
            (due if force or self._due(p[1]["from_ns"], p[1]["to_ns"], now) else waiting).append(p)
        self._pending = waiting
        for key, head in due:
            calls = self.ring.window(key, head["from_ns"], head["to_ns"])
            if not calls:
                self.empty += 1
                continue
            self._publish(head, calls)
            log.info("captured %d calls of %s rank %d around its anomaly at %d", len(calls), key[1], key[2],
                     head["window_start_ns"])
        self._requests_due(now, force)

    def _requests_due(self, now: int, force: bool) -> None:
        """Each live request's pieces that are due (at stop: those begun), captured for the ranks held here."""
        for entry in self._requests:
            start, req = entry
            while start <= req.to_ns:
                end = min(start + self.piece_ns - 1, req.to_ns)
                if not ((force and start <= now) or self._due(start, end, now)):
                    break
                self._capture_piece(req, start, end)
                start = entry[0] = end + 1
        self._requests = [e for e in self._requests if e[0] <= e[1].to_ns and not (force and e[0] > now)]

    def _capture_piece(self, req: CaptureRequest, start: int, end: int) -> None:
        for key, calls in sorted(self.ring.windows(req.matches, start, end).items()):
            head = {"tenant": key[0], "job": key[1], "host": self.cfg.host, "rank": key[2], "window_start_ns": start,
                    "window_end_ns": end, "from_ns": start, "to_ns": end, "request_id": req.request_id}
            self._publish(head, calls)
            self.request_pieces += 1
            log.info("captured %d calls of %s rank %d in [%d, %d] for request %s", len(calls), key[1], key[2],
                     start, end, req.request_id)

    def _publish(self, head: dict, calls: list[dict]) -> None:
        for k, v in trace_messages(head, calls, self.cfg.kafka_message_max_bytes):
            self.producer.produce(self.topic_out, value=v, key=k, headers=[("fs-schema", TRACE_SCHEMA.encode())],
                                  on_delivery=self._delivered)
        self.calls_published += len(calls)

    def _delivered(self, err, msg) -> None:
        if err is None:
            self.published += 1
        else:
            self.publish_errors += 1
            log.warning("a capture to %s was not delivered: %s", self.topic_out, err)

    def _failed(self, what: str, *args) -> None:
        self.errors += 1
        if self.errors <= 3 or self.errors % 1000 == 0:  # the first ones with their traceback, then a count
            log.exception("trace capture: " + what + " failed (%d failures so far)", *args, self.errors)

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=10)
        try:
            self.capture_due(force=True)  # what is pending goes out with what the ring still holds
            left = self.producer.flush(self.cfg.stop_flush_timeout_s)
            if left:
                log.warning("%d captures were not delivered at agent stop", left)
            self.consumer.close()
        except Exception:
            self._failed("stopping")


def attach_capture(cfg, bootstrap: str, resolver, sources: list) -> TraceCapture | None:
    """A started capture fed by the `trace` source's tracers, or None (logged) when there is nothing to capture
    or it cannot start; the agent runs on either way."""
    tracing = next((s for s in sources if getattr(s, "name", None) == "trace"), None)
    if tracing is None:
        log.warning("trace_capture_s is set but no tracer runs on this host: nothing to capture around anomalies")
        return None
    try:
        capture = TraceCapture(cfg, bootstrap, resolver).start()
    except Exception:
        log.exception("capture around anomalies is off: it failed to start")
        return None
    tracing.on_records = capture.add_records
    tracing.on_drained = capture.drained
    if not cfg.trace_capture_anomalies:  # else the tracers' detail gate is open for good (registry.py)
        capture.open_detail = tracing.open_detail
    return capture

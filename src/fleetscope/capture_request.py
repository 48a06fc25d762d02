"""The `<prefix>.control` message: a request to the agents to capture a job's per-call records over a span.

`fleetscope trace --live` publishes one; every agent that captures (`trace_capture_s > 0`,
producers/trace_capture.py) reads the topic from its ends, and one that holds ranks of the job publishes their
calls in the span to `<prefix>.traces`, as it does around an anomaly. JSON with `fs-schema: capture-request/1`
(schemas/capture_request.schema.json), keyed tenant/job:

    {request_id, tenant ("" = any), job, rank (-1 = all), from_ns, to_ns, requested_at_ns}

The span is [from_ns, to_ns] in ns since the Unix epoch, at most `trace_request_max_s` long. Both ends check
it: the command before publishing, each agent (with its own setting) before scheduling anything.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass

CAPTURE_REQUEST_SCHEMA = "capture-request/1"
FIELDS = {"request_id": str, "tenant": str, "job": str, "rank": int, "from_ns": int, "to_ns": int,
          "requested_at_ns": int}


class CaptureRequestError(ValueError):
    """A request that is malformed or out of bounds; the message says which field and why."""


@dataclass(frozen=True)
class CaptureRequest:
    request_id: str
    tenant: str
    job: str
    rank: int
    from_ns: int
    to_ns: int
    requested_at_ns: int

    def matches(self, key: tuple) -> bool:
        """Whether a (tenant, job, rank) is one the request names."""
        tenant, job, rank = key
        return job == self.job and self.tenant in ("", tenant) and self.rank in (-1, rank)

    def message(self) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
        """(key, value, headers) as published on `<prefix>.control`."""
        value = json.dumps(asdict(self), separators=(",", ":")).encode()
        return f"{self.tenant}/{self.job}".encode(), value, [("fs-schema", CAPTURE_REQUEST_SCHEMA.encode())]


def check_request(fields: dict, max_s: float) -> CaptureRequest:
    """The request `fields` make, or CaptureRequestError naming what is wrong."""
    if not isinstance(fields, dict):
        raise CaptureRequestError(f"a capture request is a JSON object, not {type(fields).__name__}")
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise CaptureRequestError(f"unknown fields {unknown}; a capture request has {list(FIELDS)}")
    missing = [f for f in FIELDS if f not in fields]
    if missing:
        raise CaptureRequestError(f"missing fields {missing}")
    for name, kind in FIELDS.items():
        value = fields[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CaptureRequestError(f"{name}={value!r}: must be {'an integer' if kind is int else 'a string'}")
    req = CaptureRequest(**fields)
    if not req.request_id or not req.job:
        raise CaptureRequestError("request_id and job must not be empty")
    if req.rank < -1:
        raise CaptureRequestError(f"rank={req.rank}: must be a rank (>= 0) or -1 (all)")
    if min(req.from_ns, req.requested_at_ns) < 0:
        raise CaptureRequestError("from_ns and requested_at_ns must be >= 0 (ns since the Unix epoch)")
    if req.to_ns <= req.from_ns:
        raise CaptureRequestError(f"to_ns={req.to_ns} must be after from_ns={req.from_ns}")
    if req.to_ns - req.from_ns > max_s * 1e9:
        raise CaptureRequestError(f"the span is {(req.to_ns - req.from_ns) / 1e9:g} s, longer than "
                                  f"trace_request_max_s={max_s:g}")
    return req


def parse_request(value: bytes, headers: dict, max_s: float) -> CaptureRequest:
    """A consumed message as a request; CaptureRequestError for another schema, bad JSON or a bad request."""
    schema = headers.get("fs-schema")
    schema = schema.decode(errors="replace") if isinstance(schema, (bytes, bytearray)) else schema
    if schema != CAPTURE_REQUEST_SCHEMA:
        raise CaptureRequestError(f"fs-schema {schema!r}, expected {CAPTURE_REQUEST_SCHEMA!r}")
    try:
        fields = json.loads(value)
    except ValueError as exc:
        raise CaptureRequestError(f"not JSON ({exc})") from None
    return check_request(fields, max_s)


def build_request(job: str, seconds: float, max_s: float, tenant: str = "", rank: int = -1,
                  now_ns: int | None = None) -> CaptureRequest:
    """A checked request for the `seconds` from now on."""
    now = time.time_ns() if now_ns is None else now_ns
    return check_request({"request_id": uuid.uuid4().hex, "tenant": tenant, "job": job, "rank": rank,
                          "from_ns": now, "to_ns": now + int(seconds * 1e9), "requested_at_ns": now}, max_s)


def publish_request(cfg, bootstrap: str, req: CaptureRequest, timeout_s: float = 10.0) -> None:
    """Publish `req` on `<prefix>.control` and wait for Kafka's acknowledgement; RuntimeError if it did not come."""
    from confluent_kafka import Producer

    from fleetscope.kafka_settings import client_conf
    failed: list = []
    producer = Producer(client_conf(cfg, bootstrap, **{"acks": "all", "client.id": "fleetscope-trace"}))
    key, value, headers = req.message()
    producer.produce(cfg.topic("control"), value=value, key=key, headers=headers,
                     on_delivery=lambda err, msg: failed.append(err) if err is not None else None)
    if producer.flush(timeout_s) or failed:
        raise RuntimeError(f"the capture request was not delivered to {cfg.topic('control')} on Kafka at "
                           f"{bootstrap}: {failed[0] if failed else f'no acknowledgement within {timeout_s:g} s'}")

"""What a decoded batch must satisfy before the worker lets it into windows and the store.

The decoder checks the bytes; these checks are about what the bytes say:
- identity and name strings are valid UTF-8 (no lone surrogates), free of
  control characters and bounded in length: one bad string used to pass the
  decoder, then fail every insert of its flush, forever;
- event times lie between the retention horizon and a bounded clock skew
  ahead: one far-future batch used to push its key's watermark years ahead,
  and events outside 1970-2106 were silently dropped by the TTL's wrap-around;
- the Kafka key is the batch's `tenant/job`, so a job's ranks and its model
  really share a partition, and so one worker.

Each failure is an AdmissionError whose text is the dead letter's reason.
"""
from __future__ import annotations

import re
import time

import numpy as np

from fleetscope.wire import Batch, StrColumn

MAX_IDENTITY_CHARS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
NS_PER_S = 10**9
NS_PER_DAY = 86_400 * NS_PER_S


class AdmissionError(ValueError):
    """A decoded batch the worker must not take in; the text says why."""


class UncheckedKey:
    """The key of a message that did not come from Kafka (a direct caller: tests, benchmarks)."""

    def __repr__(self) -> str:
        return "UNCHECKED_KEY"


UNCHECKED_KEY = UncheckedKey()


def check_string(what: str, value: str) -> None:
    if not isinstance(value, str):
        raise AdmissionError(f"{what} is not a string: {value!r}")
    if len(value) > MAX_IDENTITY_CHARS:
        raise AdmissionError(f"{what} is {len(value)} characters long (at most {MAX_IDENTITY_CHARS})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise AdmissionError(f"{what} {value!r} is not valid UTF-8 (a lone surrogate)") from None
    if _CONTROL.search(value):
        raise AdmissionError(f"{what} {value!r} contains a control character")


def check_strings(batch: Batch) -> None:
    """Every string the store will hold: the batch's host and source, and each string column's dictionary."""
    check_string("host", batch.host)
    check_string("source", batch.source)
    check_string("batch_id", batch.batch_id)
    for name, col in batch.columns.items():
        if isinstance(col, StrColumn):
            for value in col.values:  # a dictionary: a few distinct values, not one per row
                check_string(f"column {name!r} value", value)


class TimeBounds:
    """Event times the worker accepts: from `ttl_days` ago to `max_future_skew_s` ahead of its wall clock."""

    def __init__(self, ttl_days: float, max_future_skew_s: float, wall_clock_ns=time.time_ns):
        self.retention_ns = int(ttl_days * NS_PER_DAY)
        self.skew_ns = int(max_future_skew_s * NS_PER_S)
        self.wall_clock_ns = wall_clock_ns

    def check(self, ts: np.ndarray) -> None:
        if not len(ts):
            return
        now = self.wall_clock_ns()
        newest, oldest = int(ts.max()), int(ts.min())
        if newest > now + self.skew_ns:
            raise AdmissionError(
                f"event time {_iso(newest)} is {(newest - now) / NS_PER_S:.0f} s ahead of this worker's clock "
                f"(max_future_skew_s={self.skew_ns / NS_PER_S:g}): fix the sender's clock")
        if oldest < now - self.retention_ns:
            raise AdmissionError(
                f"event time {_iso(oldest)} is older than the retention (ttl_days={self.retention_ns / NS_PER_DAY:g})")


def _iso(ns: int) -> str:
    seconds = ns // NS_PER_S
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
    except (OverflowError, OSError, ValueError):
        return f"{ns} ns"


def check_key(key, batch: Batch) -> None:
    """The Kafka key must be the batch's one `tenant/job`."""
    if key is UNCHECKED_KEY or not batch.count:
        return
    tenant, job = batch.columns["tenant"], batch.columns["job"]
    tenants = {tenant.values[c] for c in np.unique(tenant.codes).tolist()}
    jobs = {job.values[c] for c in np.unique(job.codes).tolist()}
    if len(tenants) != 1 or len(jobs) != 1:
        raise AdmissionError(f"batch holds {len(tenants)} tenants and {len(jobs)} jobs; a message carries one "
                             f"tenant/job, its key")
    expected = f"{tenants.pop()}/{jobs.pop()}"
    if key is None:
        raise AdmissionError(f"message has no key; expected {expected!r}")
    try:
        got = bytes(key).decode("utf-8") if not isinstance(key, str) else key
    except UnicodeDecodeError:
        raise AdmissionError(f"message key {bytes(key)[:64]!r} is not UTF-8; expected {expected!r}") from None
    if got != expected:
        raise AdmissionError(f"message key {got!r} disagrees with the batch's tenant/job {expected!r}")

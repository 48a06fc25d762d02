"""A dead letter's free-text reason as one of a few fixed categories, for /metrics labels.

The reason text (stored whole in the `dlq` table and the `fs-dlq-reason` header) names the message, the
column, the key; as a Prometheus label it would make one series per bad message. Metrics label by category
instead, a fixed set whatever arrives:

- decode: the bytes are not a readable batch or JSON document (corrupt, truncated, wrong format);
- schema: readable, but not what the topic carries (unknown source, missing or mistyped column, bad identity
  string, wrong schema version or `fs-schema` header);
- key_mismatch: the Kafka key is missing or disagrees with the batch's tenant/job;
- timestamp: event times out of the accepted range (ahead of the clock, older than the retention);
- store_refused: the store refused the rows REJECT_AFTER times;
- handler_error: a worker step failed on an admitted message (windowing);
- other: a reason none of the above knows (a new message text: add it here).

The patterns follow the texts the decoder (wire.py, arrow_wire.py, ipc_frames.py), schema.validate,
admission.py, processor.py, store_writes.py and the sink's writer.py write; tests/test_dlq_reasons.py makes
those functions produce their reasons and checks the category of each, so a reworded message fails there.
"""
from __future__ import annotations

import re

CATEGORIES = ("decode", "schema", "key_mismatch", "timestamp", "store_refused", "handler_error", "other")

_RULES = [(category, re.compile(pattern)) for category, pattern in (
    ("timestamp", r"^event time "),
    ("key_mismatch", r"^message key |^message has no key|^batch holds \d+ tenants and \d+ jobs"),
    ("store_refused", r"^store rejected it"),
    ("handler_error", r"^windowing failed"),
    ("schema", r"^unknown source |^\S+ batch lacks column |^\S+ column '.*' must be |^schema version \d+ is "
               r"|^schema version \S+ is not a number|^fs-schema header |^the message is not a JSON object|^a '.*' batch on the \S+ topic"
               r"|^(source|tenant|job|host|batch_id|column '.*' value) .*(is not a string|characters long"
               r"|is not valid UTF-8 \(a lone surrogate\)|contains a control character)"),
    ("decode", r"^(corrupt Arrow stream|decompression bomb|truncated|bad magic|bad schema message|undecodable message"
               r"|decoding failed|empty message|message value is a|message of \d+ bytes is over|the stream holds"
               r"|the batch holds no events|a column name|column '|string column '|schema metadata key"
               r"|Kafka headers are not|header \S+=.* disagrees|columns differ in length|checksum|metadata |the batch carries no"
               r"|batch extras|batch metadata|a batch needs|batch cannot be sealed)"),
)]
# the sink's writer: f"unreadable {kind} message: {type(exc).__name__}: {exc}"
_UNREADABLE = re.compile(r"^unreadable \S+ message: \w+: ")


def dlq_category(reason: str | bytes | None) -> str:
    """The category of one dead letter's reason; 'other' for a text none of the rules knows."""
    if isinstance(reason, (bytes, bytearray)):
        reason = bytes(reason).decode("utf-8", "replace")
    text = (reason or "").strip()
    unreadable = _UNREADABLE.match(text)
    if unreadable:
        text = text[unreadable.end():]
    for category, pattern in _RULES:
        if pattern.search(text):
            return category
    # a derived message the sink could not read (JSON syntax, a model state that did not decode)
    return "decode" if unreadable else "other"


class DeadLetterCounter:
    """`fleetscope_<role>_dead_letters_total{reason}`: every category present from the start (0 until one
    arrives), so a dashboard's rate() has a series before the first dead letter."""

    def __init__(self, registry, role: str):
        from prometheus_client import Counter
        self.counter = Counter(f"fleetscope_{role}_dead_letters", f"dead letters the {role} made, by reason "
                               f"category ({', '.join(CATEGORIES)}); the full reason is in the dlq table",
                               ["reason"], registry=registry)
        for category in CATEGORIES:
            self.counter.labels(category)

    def count(self, reason) -> None:
        self.counter.labels(dlq_category(reason)).inc()

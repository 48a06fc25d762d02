"""What a flush job's transforms want stored and published, collected instead of done on the spot.

The feature builder and the scorer are handed an Outbox as their store and
their producer. Their Kafka messages and inserts are kept here; the
processor publishes the messages as a separate, retried step, so a window is
scored once however often publishing is retried (a model learning the same
window twice would drift). Of the inserts it keeps only the model
checkpoints (they become <prefix>.model-state messages): the sink builds
every other row from the topics.

It is not a Kafka producer: it acknowledges nothing, so it refuses a delivery
callback (the processor's own producer must report deliveries) instead of
letting a job wait for acknowledgements that never come.
"""
from __future__ import annotations


class Outbox:
    def __init__(self):
        self.inserts: list[tuple[str, object, str | None]] = []
        self.messages: list[tuple[str, bytes | None, bytes | None, list | None]] = []

    # the store's interface, as the transforms use it
    def insert(self, table: str, columns, dedupe_token: str | None = None) -> int:
        self.inserts.append((table, columns, dedupe_token))
        n = columns.num_rows if hasattr(columns, "num_rows") else len(next(iter(columns.values()), ()))
        return n

    # the producer's interface, as the transforms use it
    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, headers=None, **kw) -> None:
        if kw.get("on_delivery") or kw.get("callback"):
            raise TypeError("an Outbox only collects messages; it delivers none, so no delivery callback fires")
        self.messages.append((topic, key, value, headers))

    def flush(self, timeout: float | None = None) -> int:
        return 0  # nothing is in flight here: the processor publishes what was collected

    def poll(self, timeout: float | None = None) -> int:
        return 0

    def take(self) -> tuple[list, list]:
        inserts, messages = self.inserts, self.messages
        self.inserts, self.messages = [], []
        return inserts, messages

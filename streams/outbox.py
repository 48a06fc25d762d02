"""What a flush job's transforms want stored and published, collected instead of done on the spot.

The feature sink and the scorer are handed an Outbox as their store and
their producer. Their queries (stored window marks, model checkpoints to
restore) go to the real store; their inserts and Kafka messages are kept
here. The processor then publishes the messages and stores the inserts as
separate, retried steps, so that:
- a window is scored once, however often its storing is retried (a model
  learning the same window twice would drift);
- a store outage stops neither computing nor publishing: alerts keep flowing.
"""
from __future__ import annotations


class Outbox:
    def __init__(self, store):
        self.store = store
        self.inserts: list[tuple[str, object, str | None]] = []
        self.messages: list[tuple[str, bytes | None, bytes | None, list | None]] = []

    # the store's interface, as the transforms use it
    def query(self, sql: str, params: dict | None = None):
        return self.store.query(sql, params)

    def insert(self, table: str, columns, dedupe_token: str | None = None) -> int:
        self.inserts.append((table, columns, dedupe_token))
        n = columns.num_rows if hasattr(columns, "num_rows") else len(next(iter(columns.values()), ()))
        return n

    # the producer's interface, as the transforms use it
    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, headers=None, **_) -> None:
        self.messages.append((topic, key, value, headers))

    def flush(self, timeout: float | None = None) -> int:
        return 0  # nothing is in flight here: the processor publishes what was collected

    def poll(self, timeout: float | None = None) -> int:
        return 0

    def take(self) -> tuple[list, list]:
        inserts, messages = self.inserts, self.messages
        self.inserts, self.messages = [], []
        return inserts, messages

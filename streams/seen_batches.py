"""Batch ids handled in this run (bounded, oldest forgotten first): a batch the agent sent twice counts once."""
from __future__ import annotations

from collections import OrderedDict


class SeenBatches:
    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, batch_id: str) -> bool:
        """True if new."""
        if batch_id in self._ids:
            return False
        self._ids[batch_id] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return True

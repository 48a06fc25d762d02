"""Publishes each flush's energy per operator (streams/energy_features.py) on <prefix>.features.

One Arrow batch per job, tagged extras rows=operator_energy, so the sink stores
it in `operator_energy` (streams/sink/tables.py) and not as feature rows. It
rides the features topic, so it is published, committed and replayed with the
feature rows of the same windows.
"""
from __future__ import annotations

import socket

from fleetscope import wire
from fleetscope.schema import NODE_TENANT
from fleetscope.streams.energy_features import energy_batch
from fleetscope.streams.features import FEATURE_VERSION


class OperatorEnergySink:
    def __init__(self, cfg, producer):
        self.cfg = cfg
        self.producer = producer
        self.host = socket.gethostname()
        self.batches = 0

    def write(self, windows) -> None:
        by_job: dict[tuple[str, str], list] = {}
        for w in windows:
            if w.key[0] != NODE_TENANT:  # a node's GPU energy belongs to no operator of its own
                by_job.setdefault(w.key[:2], []).append(w)
        topic = self.cfg.topic("features")
        for (tenant, job), members in by_job.items():
            batch = energy_batch(self.host, members, FEATURE_VERSION)
            if batch is None:
                continue
            self.producer.produce(topic, key=f"{tenant}/{job}".encode(), value=wire.encode(batch),
                                  headers=batch.kafka_headers())
            self.batches += 1

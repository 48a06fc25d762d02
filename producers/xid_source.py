"""The agent's `xid` source: NVML's critical events (Xid, double-bit ECC, clock changes) as they happen.

They cannot wait for the tick (an Xid explains an anomaly only if it reaches the pipeline before the
window closes), so the watcher publishes each event itself on its own thread; on the tick this source
has nothing to add.
"""
from __future__ import annotations

from fleetscope.producers.nvml.xid_watcher import XidWatcher


class XidSource:
    name = "xid"

    def __init__(self, watcher: XidWatcher):
        self.watcher = watcher

    def sample(self, now_ns: int) -> None:
        return None  # every event was published the moment it arrived

    def stats(self) -> dict:
        return {}  # a watcher that cannot run publishes one nvml.status row instead

    def close(self) -> None:
        self.watcher.stop()


def build_source(cfg, new_resolver, publish) -> XidSource:
    return XidSource(XidWatcher(cfg.host, publish, library_path=cfg.nvml_library).start())

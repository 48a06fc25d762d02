"""NcclTracer: NCCL collectives and point-to-point calls by uprobes on libnccl.

Rows (source "nccl"), per pid:
- per call (device "AllReduce", "AllGather", "ReduceScatter", "Broadcast",
  "Reduce", "Send", "Recv", and "GroupStart"/"GroupEnd"/"CommInitRank"/
  "CommInitRankConfig"/"CommSplit"/"CommInitAll"):
  nccl.calls, nccl.dur_ns, nccl.errors, nccl.bytes (count x datatype size,
  collectives only), nccl.lat_p50_ns, nccl.lat_p99_ns (see gpu_calls.py);
- nccl.peer_bytes, device "Send:peer<N>" / "Recv:peer<N>";
- nccl.comm_rank, nccl.comm_nranks (gauges, device = the ncclComm_t in hex),
  every sample while the process lives, from each successful
  ncclCommInitRank and ncclCommInitRankConfig (PyTorch's way), from
  ncclCommInitAll (comms[i] is rank i of ndev) and from ncclCommSplit: NCCL
  orders a split's ranks by key and PyTorch passes the new group rank as the
  key, so the rank is the key; the size is not an argument, so a split
  communicator has no nccl.comm_nranks row;
- nccl.lost_events.

NCCL calls enqueue work on a stream: their duration is the host-side call
time (and, in this uprobe setup, includes the probe pair's own few µs).
One family, "collectives", always on.
"""
from __future__ import annotations

import re

from fleetscope.producers.tracers.gpu_calls import Api, GpuCallTracer

DTYPES = {0: ("int8", 1), 1: ("uint8", 1), 2: ("int32", 4), 3: ("uint32", 4), 4: ("int64", 8), 5: ("uint64", 8),
          6: ("float16", 2), 7: ("float32", 4), 8: ("float64", 8), 9: ("bfloat16", 2),
          10: ("float8e4m3", 1), 11: ("float8e5m2", 1)}
OPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
_NONE = (1 << 64) - 1


def _api(call: str, has_bytes=True):
    return Api(f"nccl{call}", "collectives", "nccl", label=call, has_bytes=has_bytes)


class NcclTracer(GpuCallTracer):
    SOURCE = "nccl"
    BPF_FILE = "nccl.bpf.c"
    LIBRARIES = {"nccl": re.compile(r"/libnccl\.so[.\d]*$")}
    FAMILIES = {"collectives": "always"}
    RETURN_PROBES = {r"nccl\w+": "the NCCL API is C: every failure is an ncclResult_t return value (NCCL's "
                                  "C++ internals catch their own exceptions at the API boundary)"}
    APIS = (*(_api(c) for c in ("AllReduce", "ReduceScatter", "AllGather", "Broadcast", "Reduce", "Send", "Recv")),
            *(_api(c, has_bytes=False) for c in ("GroupStart", "GroupEnd", "CommInitRank", "CommInitRankConfig",
                                                 "CommSplit", "CommInitAll")))
    PID_MAPS = ("stats", "peer_bytes", "comms")

    def _extra_rows(self, interval, fracs):
        def peer_label(key):
            return f"{self.APIS[key[1]].device}:peer{_signed(key[2])}", "collectives"

        rows = self._sum_rows(b"peer_bytes", "_prev_peers", peer_label, "nccl.peer_bytes", interval, fracs)
        for k, info in self.bpf[b"comms"].items():
            comm, pid = f"0x{k.sub:x}", int(k.pid)
            rows.append(("nccl.comm_rank", comm, info.rank, pid, 0, 1.0))
            if info.nranks >= 0:  # a split's size is unknown
                rows.append(("nccl.comm_nranks", comm, info.nranks, pid, 0, 1.0))
        return rows

    def _decode(self, api: Api, pid: int, a: list[int]) -> dict:
        if api.device in ("CommInitRank", "CommInitRankConfig"):
            return {"comm": a[4], "nranks": _signed(a[1]), "rank": _signed(a[3])}
        if api.device == "CommSplit":
            return {"comm": a[4], "parent": a[5], "color": _signed(a[2]), "rank": _signed(a[3])}
        if api.device == "CommInitAll":
            return {"comm": a[4], "nranks": _signed(a[1])}  # the first of nranks; each is in the comms map
        if api.device in ("GroupStart", "GroupEnd"):
            return {}
        name, size = DTYPES.get(a[1], (f"dtype{a[1]}", 0))
        rec = {"count": a[0], "datatype": name, "bytes": a[0] * size, "comm": a[4], "stream": a[5]}
        if a[2] != _NONE:
            rec["op"] = OPS.get(a[2] & 0xFFFFFFFF, a[2])
        if a[3] != _NONE:
            rec["root" if api.device in ("Broadcast", "Reduce") else "peer"] = _signed(a[3])
        return rec


def _signed(v: int) -> int:
    """A C int widened to u64 in BPF, back to a Python int."""
    return v - (1 << 64) if v >= 1 << 63 else v

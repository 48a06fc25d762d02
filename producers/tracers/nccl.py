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
- nccl.comm_seq (gauge, device = the communicator's uid in hex): how many
  collectives (AllReduce, ReduceScatter, AllGather, Broadcast, Reduce) the
  process has entered on it since its init, for communicators whose init
  was traced. The uid is the first 8 bytes of the ncclUniqueId every rank of
  the communicator was given (NCCL's random magic); a split's is its
  parent's and its color's. So the n-th collective of a communicator is the
  same call on every rank, and ranks on different hosts can be compared;
- nccl.coll_entry_ns (gauge, device "<uid>#<n>"): when the process entered
  the communicator's n-th collective (epoch ns), for the marked n: every
  one while a communicator runs fewer than MARKS_PER_TICK collectives per
  sample, else every 2^k-th, k the same on every rank of a communicator
  that runs at the same rate (the rate is the communicator's, not the
  rank's). The worker compares the ranks' entry times of the same n: the
  rank that arrives last is the one its peers wait for
  (streams/arrival.py). ncclCommInitAll's communicators live in one
  process and have no uid: nothing to compare;
- nccl.lost_events.

NCCL calls enqueue work on a stream: their duration is the host-side call
time (and, in this uprobe setup, includes the probe pair's own few µs).
One family, "collectives", always on.
"""
from __future__ import annotations

import re

from fleetscope.producers.tracers.gpu_calls import Api, GpuCallTracer

SEQ_MARKS = 64       # NCCL_SEQ_MARKS in bpf/events.h: the ring of marked entry times per communicator
MARKS_PER_TICK = 32  # mark densely while a communicator's collectives per sample fit half the ring
MAX_SHIFT = 15       # bpf/nccl.bpf.c masks the shift to 4 bits

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
    PID_MAPS = ("stats", "peer_bytes", "comms", "comm_seq", "seq_shift")

    def _extra_rows(self, interval, fracs):
        def peer_label(key):
            return f"{self.APIS[key[1]].device}:peer{_signed(key[2])}", "collectives"

        rows = self._sum_rows(b"peer_bytes", "_prev_peers", peer_label, "nccl.peer_bytes", interval, fracs)
        for k, info in self.bpf[b"comms"].items():
            comm, pid = f"0x{k.sub:x}", int(k.pid)
            rows.append(("nccl.comm_rank", comm, info.rank, pid, 0, 1.0))
            if info.nranks >= 0:  # a split's size is unknown
                rows.append(("nccl.comm_nranks", comm, info.nranks, pid, 0, 1.0))
        return rows + self._sequence_rows()

    def _sequence_rows(self) -> list[tuple]:
        """nccl.comm_seq per communicator, and the entry times of the marks not sent before."""
        rows = []
        sent = getattr(self, "_marks_sent", {})
        rates = getattr(self, "_seq_seen", {})
        self._marks_sent, self._seq_seen = {}, {}
        shifts = self.bpf[b"seq_shift"]
        for k, v in self.bpf[b"comm_seq"].items():
            key, pid, seq = (int(k.pid), int(k.sub)), int(k.pid), int(v.seq)
            uid = f"{int(v.uid):016x}"
            last = sent.get(key, 0)
            if seq < last:  # the communicator was made again at this address: counting restarted
                last = 0
            newest = last
            for m in v.marks:
                n = int(m.seq)
                if n > last and m.ts:
                    rows.append(("nccl.coll_entry_ns", f"{uid}#{n}", self.clock.to_epoch_ns(int(m.ts)), pid, 0, 1.0))
                    newest = max(newest, n)
            rows.append(("nccl.comm_seq", uid, seq, pid, 0, 1.0))
            self._marks_sent[key] = newest
            self._seq_seen[key] = seq
            per_tick = seq - rates.get(key, 0)  # since the last sample, or since the init
            shift, at = mark_shift(per_tick), shifts.Key(k.pid, k.api, k.sub)
            if shift:
                shifts[at] = shifts.Leaf(shift)
            elif at in shifts:
                del shifts[at]
        return rows

    def _decode(self, api: Api, pid: int, a: list[int]) -> dict:
        if api.device in ("CommInitRank", "CommInitRankConfig"):
            return {"comm": a[4], "nranks": _signed(a[1]), "rank": _signed(a[3]), "uid": f"{a[5]:016x}"}
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


def mark_shift(collectives_per_tick: int) -> int:
    """Mark every 2^k-th collective: the least k that keeps a tick's marks within MARKS_PER_TICK. Powers of
    two nest, so ranks that pick k and k+1 for a tick (a rate at the edge) still share every 2^(k+1)-th."""
    k = 0
    while k < MAX_SHIFT and collectives_per_tick > MARKS_PER_TICK << k:
        k += 1
    return k


def _signed(v: int) -> int:
    """A C int widened to u64 in BPF, back to a Python int."""
    return v - (1 << 64) if v >= 1 << 63 else v

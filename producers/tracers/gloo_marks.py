"""When each rank issued each gloo collective: the arrival marks of torch.distributed's gloo backend.

Every rank of a ProcessGroupGloo numbers its collectives with the group's
counter (c10d::ProcessGroupGloo::nextTag(), called once per collective by the
thread that issues it); gloo matches the ranks' messages by that tag, so the
counters of all ranks of a group stay in step from the group's creation on.
The torch tracer probes nextTag at its entry (the group and the time) and at
its `ret` instruction (the returned tag, read from the return register), and
records (pid, group, tag) -> entry time (bpf/torch.bpf.c, `coll_marks`).
Unlike NCCL's marks (producers/tracers/nccl.py), no init needs to be seen:
the tag itself is the sequence number, so a tracer that attaches mid-run
numbers collectives as the ranks do.

What this module makes of the marks, per sample:
- torch.coll_entry_ns (gauge, device "gloo<g>#<tag>"): when the process
  issued that collective, in epoch ns. <g> numbers the process's groups in the
  order their first collective was seen: the default group is 0 on every rank
  of a job whose collectives run on one group (DDP's case). A job whose ranks
  start collectives on several groups in different orders, or that the
  tracer met at different points of their group use, can number them
  differently on different ranks; its marks are then not comparable
  (streams/arrival.py compares only marks every rank reported).
- torch.coll_issued (delta, device "gloo<g>"): collectives issued, marked or
  not; the arrival features use it for the rate of collectives, the job's own
  history for the job's rate, the hang check for silence. A group seen before
  gets a measured 0 in a sample in which its process, still traced, issued
  none: a rank stuck in a collective issues no more (silence, not unknown).
A group issuing more than MARKS_PER_TICK collectives in a sample keeps only
the tags divisible by 2^k (nccl.mark_shift), the same rule on every rank, so
ranks keep comparable marks.

streams/arrival.py turns the marks of a job's ranks into who arrived last.
"""
from __future__ import annotations

import logging

from fleetscope.producers.tracers.nccl import mark_shift
from fleetscope.producers.tracers.return_sites import return_sites

log = logging.getLogger(__name__)

NEXT_TAG = "c10d::ProcessGroupGloo::nextTag()"
NEXT_TAG_MANGLED = "_ZN4c10d16ProcessGroupGloo7nextTagEv"


def tag_probe_sites(functions, path: str) -> tuple[int, tuple[int, ...]] | None:
    """(address, `ret` addresses) of nextTag among `functions` ((address, size, demangled name) of
    libtorch_cpu's exported functions), or None where it is not exported or has no `ret`."""
    for addr, size, name in functions:
        if name == NEXT_TAG:
            rets = return_sites(path, addr, size).rets
            if rets:
                return addr, rets
            log.warning("torch tracer: %s in %s has no ret instruction; no gloo arrival marks", name, path)
    return None


class GlooMarks:
    """Turns the BPF table of marks into rows; remembers each process's groups."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self._groups: dict[int, dict[int, int]] = {}  # pid -> {group address: its number in this process}

    def rows(self, table, interval: int, frac: float, traced=()) -> list[tuple]:
        """Read and empty `table` (coll_marks): the marks and counts of every group since the last sample; a
        measured 0 for each known group of the `traced` pids (the marks attached) that issued none."""
        marks = sorted(((int(k.pid), int(k.group), int(k.tag), int(getattr(v, "value", v)))
                        for k, v in table.items_lookup_and_delete_batch()), key=lambda m: m[3])
        by_group: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for pid, group, tag, ts in marks:
            groups = self._groups.setdefault(pid, {})
            number = groups.setdefault(group, len(groups))
            by_group.setdefault((pid, number), []).append((tag, ts))
        for pid in traced:
            for number in self._groups.get(pid, {}).values():
                by_group.setdefault((pid, number), [])
        rows = []
        for (pid, number), issued in sorted(by_group.items()):
            rows.append(("torch.coll_issued", f"gloo{number}", len(issued), pid, interval, frac))
            step = 1 << mark_shift(len(issued))
            rows += [("torch.coll_entry_ns", f"gloo{number}#{tag}", self.clock.to_epoch_ns(ts), pid, 0, 1.0)
                     for tag, ts in issued if tag % step == 0]
        return rows

    def forget(self, pid: int) -> None:
        self._groups.pop(int(pid), None)

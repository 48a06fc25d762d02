"""Runs the configured tracers for the agent: finds targets, attaches, duty-cycles, samples.

- Targets come from a ProcessWatcher (pids, a name pattern, or every process
  mapping a GPU/ML library), polled every `trace_poll_s`. A process that does
  not map a tracer's library yet (it will dlopen it later) is retried on
  every poll until it does or exits.
- A tracer this host cannot run (no root, no bcc, no USDT, a module not
  present) is reported once with its reason and skipped; the others run.
- An attach that raised (bcc could not create a probe's link, a USDT
  context failed: seen on loaded hosts as the process mapped libraries)
  is undone (remove_pid) and tried again after 1, 2, 4 and 8 polls; after
  ATTACH_RETRIES failures the process stays untraced by that tracer,
  logged once (`trace_attach_failures`, `trace_attach_given_up`).
- A background thread runs the overhead governor's duty cycles: every
  `trace_duty_period_s` it takes new duties, attaches each expensive family
  at the period's start and detaches it after duty × period. An always-on
  family is attached all period, unless the always-on families alone
  exceed the budget and the governor shed it (duty 0: detached for the
  period; `trace_always_shed` and `trace_shed.<tracer>.<family>` in stats).
- Each tracer has its own lock (bcc objects are not thread-safe). The agent's
  tick never waits on one: attaching a process can compile a BPF program for
  seconds (USDT), and a tick blocked behind it stopped the host and process
  samplers too, leaving windows with no data (measured in the evaluation runs:
  gaps of 2-8 s). A tracer that is busy is sampled on the next tick instead;
  its maps keep counting meanwhile and the next deltas span both ticks, so
  nothing is lost. Deferred samples are counted (`trace_samples_deferred`).
"""
from __future__ import annotations

import logging
import threading
import time

from fleetscope.config import ConfigError
from fleetscope.producers.tracers.discovery import ProcessWatcher, TargetSpec, library_stamp
from fleetscope.producers.tracers.governor import (ALWAYS, EXPENSIVE, OverheadGovernor, budget_base_s,
                                                   host_idle_seconds, process_cpu_seconds)
from fleetscope.producers.tracers.kernel import TracerUnavailable
from fleetscope.producers.tracers.registry import load_tracer

log = logging.getLogger(__name__)
FAILED = object()  # what _call returns when the call raised
ATTACH_RETRIES = 4  # a raised attach is tried again this many times, after 1, 2, 4, 8 polls
# A traced process that used at least this share of a core in a period ran in it: its wall time counts in
# the budget's base (governor.budget_base_s). Below it, an idle helper (torchrun's launcher) that takes no
# hits would lend its wall time to the others' probes.
ACTIVE_CPU_FRAC = 0.01


class TracerManager:
    def __init__(self, cfg, resolver=None, tracers: dict | None = None, hit_cost_ns: float | None = None):
        self.cfg = cfg
        self.unavailable: dict[str, str] = {}
        self.tracers: dict = {}
        if tracers is not None:  # injected (tests, embedding)
            self.tracers = dict(tracers)
        else:
            for name in cfg.trace:
                try:
                    self.tracers[name] = load_tracer(name, cfg, resolver)
                except TracerUnavailable as e:
                    self.unavailable[name] = str(e)
                    log.warning("tracer %s not started: %s", name, e)
        self.locks = {name: threading.RLock() for name in self.tracers}  # one call per tracer at a time
        self.deferred = 0
        self.on_records = None  # (tracer name, its detail records) after each sample: the anomaly capture
        self.on_drained = None  # (wall ns) after each tick: every detail tracer was sampled at or after it
        self._sampled_at: dict[str, int] = {}  # tracer name -> now_ns of its last sample that did not fail
        # the other way, set_detail_until opens the tracers' detail records for a live capture request
        if hit_cost_ns is None:
            hit_cost_ns = cfg.trace_hit_cost_ns or self._calibrate()
        self.hit_cost_ns = hit_cost_ns
        self.governor = OverheadGovernor(cfg.trace_budget, hit_cost_ns)
        self.enabled: dict[tuple[str, str], bool] = {}
        off = set(cfg.trace_off)
        try:
            _check_trace_off(off, self.tracers)
        except ConfigError:
            for tracer in self.tracers.values():   # the tracers loaded so far hold BPF programs
                if hasattr(tracer, "close"):
                    tracer.close()
            raise
        for name, tracer in self.tracers.items():
            for family, kind in _families(tracer).items():
                if f"{name}.{family}" in off:   # never attached (trace_off), and not charged to the budget
                    self.enabled[(name, family)] = True
                    self._set(name, family, False)
                    continue
                duty = self.governor.register(name, family, kind)
                self.enabled[(name, family)] = True
                if kind == EXPENSIVE and duty < 1:
                    self._set(name, family, False)
        spec = TargetSpec(pids=tuple(int(p) for p in cfg.trace_pids), name_pattern=cfg.trace_name,
                          auto=cfg.trace_auto)
        self.watcher = ProcessWatcher(spec)
        self.attached: dict[str, set[int]] = {name: set() for name in self.tracers}
        # not mapping the tracer's library yet: pid -> library stamp at that attempt (retried when it moves)
        self.waiting: dict[str, dict[int, int | None]] = {name: {} for name in self.tracers}
        # an attach raised: pid -> (failures so far, monotonic time of the next try); given up: (failures, inf)
        self.failing: dict[str, dict[int, tuple[int, float]]] = {name: {} for name in self.tracers}
        self.attach_failures = self.attach_given_up = 0
        # (tracer, pid) -> wall time of its first attempt's outcome, or of its attach (see traced_since)
        self.tried_at: dict[tuple[str, int], float] = {}
        self.last_decision = None
        self.errors = 0
        self._cpu_prev: dict[int, float] = {}
        self._idle_prev: float | None = host_idle_seconds()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_poll = time.monotonic()

    def _calibrate(self) -> float:
        if not any(EXPENSIVE in _families(t).values() for t in self.tracers.values()):
            return 6000.0  # nothing to duty-cycle: the value is never used
        from fleetscope.producers.tracers.calibrate import calibrate_hit_cost_ns
        try:
            return calibrate_hit_cost_ns()
        except Exception as e:  # calibration is best effort; the documented VM figure stands in
            log.warning("probe cost calibration failed (%s); assuming 6 µs per hit", e)
            return 6000.0

    # ---- targets --------------------------------------------------------------
    def poll_targets(self) -> None:
        found, ended = self.watcher.poll()
        for pid in ended:
            for name, tracer in self.tracers.items():
                self.waiting[name].pop(pid, None)
                self.failing[name].pop(pid, None)
                self.tried_at.pop((name, pid), None)
                if pid in self.attached[name]:
                    self.attached[name].discard(pid)
                    self._call(name, tracer.remove_pid, pid)
        stamps: dict[int, int | None] = {}
        # quick attaches first: a tracer that compiles per process (USDT) must not hold up the others' probes
        in_attach_order = sorted(self.tracers.items(), key=lambda item: bool(getattr(item[1], "SLOW_ATTACH", False)))
        now = time.monotonic()
        for name, tracer in in_attach_order:
            waiting, failing = self.waiting[name], self.failing[name]
            retry = {pid for pid, (_, at) in failing.items() if at <= now}
            for pid in sorted(found | waiting.keys() | retry):
                if pid in self.attached[name] or (pid in failing and pid not in retry):
                    continue
                if pid not in stamps:
                    stamps[pid] = library_stamp(pid)
                if pid in waiting and waiting[pid] == stamps[pid]:
                    continue  # no library mapped since the last attempt
                if pid not in self._cpu_prev:
                    # its CPU counts from its attach on, as its hits do: counted from the period's end only,
                    # a rank attached mid-period made its hits look many times the budget (the governor)
                    self._cpu_prev[pid] = process_cpu_seconds([pid])
                ok = self._call(name, tracer.add_pid, pid)
                self.tried_at.setdefault((name, pid), time.time())
                if ok is FAILED:  # it raised (logged)
                    self._attach_failed(name, tracer, pid)
                    continue
                failing.pop(pid, None)
                if ok is False:  # not mapping the library yet
                    waiting[pid] = stamps[pid]
                else:  # True, or None from tracers whose add_pid returns nothing
                    waiting.pop(pid, None)
                    self.attached[name].add(pid)
                    self.tried_at[(name, pid)] = time.time()
                    log.info("tracing pid %d with the %s tracer", pid, name)

    def _attach_failed(self, name: str, tracer, pid: int) -> None:
        """Undo what the raised attach left (a retry starts clean) and schedule the next try, or give up."""
        self._call(name, tracer.remove_pid, pid)
        self.attach_failures += 1
        failures = self.failing[name].get(pid, (0, 0.0))[0] + 1
        if failures > ATTACH_RETRIES:
            self.failing[name][pid] = (failures, float("inf"))
            self.attach_given_up += 1
            log.warning("the %s tracer gave up on pid %d after %d failed attaches: it is not traced by it",
                        name, pid, failures)
            return
        self.failing[name][pid] = (failures, time.monotonic() + self.cfg.trace_poll_s * 2 ** (failures - 1))

    def traced_since(self, pids) -> float | None:
        """The wall time by which every tracer had tried each of ``pids`` (attached it, found it not mapping
        the tracer's library yet, or failed on it; a later attach counts from then), or None while a tracer
        has not tried one of them (not found yet: it maps no library that automatic tracing attaches to, or
        an attach is compiling). What a caller waits on before it trusts that every source it will see from
        these processes has started: the evaluation harness, so that no fault starts as a tracer joins."""
        times = [self.tried_at.get((name, int(pid))) for name in self.tracers for pid in pids]
        if any(t is None for t in times):
            return None
        return max(times, default=0.0)

    def _call(self, name: str, fn, *args):
        with self.locks[name]:
            try:
                return fn(*args)
            except Exception:  # one process or tracer failing must not stop the rest
                self.errors += 1
                log.exception("%s%s failed", getattr(fn, "__qualname__", fn), args)
                return FAILED

    # ---- duty cycling -------------------------------------------------------------
    def _set(self, name: str, family: str, on: bool) -> None:
        if self.enabled.get((name, family)) == on:
            return
        self._call(name, self.tracers[name].set_family_enabled, family, on)
        self.enabled[(name, family)] = on

    def _budget_base_s(self, period_s: float) -> tuple[float, float]:
        """The governor's base for the period just ended (the targets' CPU time, or their wall time while
        they mostly wait and the host has idle CPU: governor.budget_base_s), and their CPU time."""
        pids = set().union(*self.attached.values()) if self.attached else set()
        now = {pid: process_cpu_seconds([pid]) for pid in pids}
        used = {pid: max(v - self._cpu_prev.get(pid, v), 0.0) for pid, v in now.items()}
        self._cpu_prev = now
        idle = host_idle_seconds()
        idle_s = 0.0 if idle is None or self._idle_prev is None else idle - self._idle_prev
        self._idle_prev = idle
        active = sum(1 for u in used.values() if u >= ACTIVE_CPU_FRAC * period_s)
        cpu_s = sum(used.values())
        return budget_base_s(cpu_s, active, period_s, idle_s), cpu_s

    def run_period(self, period_s: float) -> None:
        """One duty-cycle period: decide, attach, detach on time, account on-time."""
        hits = {}
        for name, tracer in self.tracers.items():
            if hasattr(tracer, "hits"):
                with self.locks[name]:
                    for family, n in tracer.hits().items():
                        hits[(name, family)] = n
        before = set(self.last_decision.shed) if self.last_decision is not None else set()
        base_s, cpu_s = self._budget_base_s(period_s)
        self.last_decision = decision = self.governor.update(hits, base_s, period_s, cpu_s=cpu_s)
        for name, family in sorted(set(decision.shed) - before):
            log.warning("always-on family %s.%s shed: the always-on probes alone cost more than trace_budget=%g "
                        "of the traced processes' time; it is retried every %d periods", name, family,
                        self.cfg.trace_budget, self.governor.shed_periods)
        start = time.monotonic()
        attached_at = {}
        for key, duty in decision.duties.items():
            if duty > 0:  # 0: its budget bucket is empty, it sits this period out
                self._set(*key, True)
                attached_at[key] = time.monotonic()
        for key, duty in sorted(decision.duties.items(), key=lambda kv: kv[1]):
            if key not in attached_at:
                self._set(*key, False)
            elif duty < 1.0:
                self._wait_until(attached_at[key] + duty * period_s)
                self._set(*key, False)
                self.governor.record_on_time(key, time.monotonic() - attached_at[key])
            else:
                self.governor.record_on_time(key, period_s)
        self._wait_until(start + period_s)

    def _wait_until(self, t: float) -> None:
        while not self._stop.is_set():
            left = t - time.monotonic()
            if left <= 0:
                return
            self._stop.wait(min(left, self.cfg.trace_poll_s))
            if time.monotonic() - self._last_poll >= self.cfg.trace_poll_s:
                self._last_poll = time.monotonic()
                self.poll_targets()

    def start(self) -> "TracerManager":
        self._last_poll = time.monotonic()
        self.poll_targets()
        self._thread = threading.Thread(target=self._loop, name="tracer-governor", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_period(self.cfg.trace_duty_period_s)
            except Exception:  # the governor must keep running; a failure leaves families as they are
                self.errors += 1
                log.exception("duty-cycle period failed")
                self._stop.wait(self.cfg.trace_duty_period_s)

    # ---- the agent's view ------------------------------------------------------------
    def sample(self, now_ns: int) -> list:
        batches = []
        for name, tracer in self.tracers.items():
            lock = self.locks[name]
            if not lock.acquire(blocking=False):  # attaching or toggling: sample it next tick
                self.deferred += 1
                continue
            try:
                batch = self._call(name, tracer.sample, now_ns)
                records = getattr(tracer, "records", None)  # detail mode: this sample's calls
                if records and self.on_records is not None and batch is not FAILED:
                    self.on_records(name, records)  # never raises (producers/trace_capture.py)
            finally:
                lock.release()
            if batch is not FAILED:
                self._sampled_at[name] = now_ns
            if batch is not None and batch is not FAILED:
                batches.append(batch)
        self._report_drained()
        return batches

    def _report_drained(self) -> None:
        """Tell the capture up to when every detail tracer's records have reached it: the oldest of their last
        samples (a tracer deferred or failing holds it back). Never raises."""
        detail = [name for name, tracer in self.tracers.items() if getattr(tracer, "detail", False)]
        if self.on_drained is None or not detail:
            return
        try:
            self.on_drained(min(self._sampled_at.get(name, 0) for name in detail))
        except Exception:
            self.errors += 1
            log.exception("reporting the tracers' drained time to the capture failed")

    def set_detail_until(self, monotonic_ns: int) -> int:
        """Open every detail-mode tracer's per-call records until CLOCK_MONOTONIC `monotonic_ns`; how many were
        set. Not under the tracers' locks: an attach may hold one for seconds, and setting the gate is one BPF
        map update that bcc does beside the tracer's other calls. Never raises (logged, counted)."""
        done = 0
        for name, tracer in self.tracers.items():
            if not getattr(tracer, "detail", False) or not hasattr(tracer, "set_detail_until"):
                continue
            try:
                done += bool(tracer.set_detail_until(monotonic_ns))
            except Exception:  # closed under us at stop, or the map refused: the tick goes on
                self.errors += 1
                log.exception("opening the detail records of the %s tracer failed", name)
        return done

    def stats(self) -> dict:
        out = {"trace_targets": len(set().union(*self.attached.values())) if self.attached else 0,
               "trace_tracers_running": len(self.tracers), "trace_tracers_unavailable": len(self.unavailable),
               "trace_errors": self.errors, "trace_hit_cost_ns": self.hit_cost_ns,
               "trace_samples_deferred": self.deferred, "trace_attach_failures": self.attach_failures,
               "trace_attach_given_up": self.attach_given_up}
        dumps = [t.idle_dumps for t in self.tracers.values() if hasattr(t, "idle_dumps")]
        if dumps:   # stacks the py-spy sampler read as a process went idle (idle_watch.py)
            out["trace_python_idle_dumps"] = sum(dumps)
        if self.last_decision is not None:
            d = self.last_decision
            out["trace_budget_used_frac"] = d.spent_s / d.budget_s if d.budget_s > 0 else 0.0
            for (name, family), duty in d.duties.items():
                out[f"trace_duty.{name}.{family}"] = duty
            # always-on families detached because they alone exceeded the budget (see governor.py)
            out["trace_always_shed"] = len(d.shed)
            for name, family in d.shed:
                out[f"trace_shed.{name}.{family}"] = 1
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for name, tracer in self.tracers.items():
            self._call(name, tracer.close)


def _families(tracer) -> dict[str, str]:
    fams = tracer.families() if hasattr(tracer, "families") else {}
    return {f: (k if k in (EXPENSIVE, ALWAYS) else ALWAYS) for f, k in fams.items()}


def _check_trace_off(off: set[str], tracers: dict) -> None:
    """A trace_off entry naming a family its (loaded) tracer does not have is a clear error, not a probe left
    on: a misspelt name would otherwise attach what the operator meant to keep off."""
    for item in sorted(off):
        name, _, family = item.partition(".")
        if name in tracers and hasattr(tracers[name], "families") and family not in _families(tracers[name]):
            raise ConfigError(f"trace_off: the {name} tracer has no probe family {family!r}; "
                              f"it has {sorted(_families(tracers[name]))}")


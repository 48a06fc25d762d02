"""What each fault really did to the job: the step rate per rank per window, and each fault's
measured impact (% change of the step rate during its bursts against before it).

Both workloads append {"t": unix time, "steps": N, "pid": P} lines to
<progress dir>/progress-rank<R>.jsonl about every 0.25 s while they step. A rank's cumulative
step count is the piecewise-linear curve through those points (a restarted rank, a new pid,
continues from where the old one stopped); a window's rate is the curve's rise over the window.
A rank that stops stepping (a hang, a crash) writes nothing more, so its curve stays flat: rate 0.

A fault whose slowdown is smaller than MIN_IMPACT_PCT, or than NOISE_FACTOR times the standard
error of the rate before it, is "no effect": it is reported, never scored as a hit or a miss.
Every fault the harness injects is an inefficiency, so only a slowdown is its impact: a job that
stepped faster while it ran (the dev runs of job_wide_slowdown and thp_off at +8.8% and +8.1%,
their "before" still settling) shows a fault that did nothing measurable, not one to detect.
"""
from __future__ import annotations

import json
import math
import statistics
from bisect import bisect_right
from pathlib import Path

MIN_IMPACT_PCT = 5.0   # below this a slowdown is within run-to-run variation of these workloads
NOISE_FACTOR = 3.0


def read_progress(directory: Path) -> dict[int, list[tuple[float, float]]]:
    """rank -> [(t, cumulative steps)], sorted by time; restarts continue the count."""
    out: dict[int, list[tuple[float, float]]] = {}
    for f in sorted(Path(directory).glob("progress-rank*.jsonl")):
        rank = int(f.stem.removeprefix("progress-rank"))
        rows = []
        for line in f.read_text().splitlines():
            try:
                d = json.loads(line)
                rows.append((float(d["t"]), float(d["steps"]), int(d["pid"])))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill: the next one carries the count on
        rows.sort()
        curve, offset, last_pid, last_steps = [], 0.0, None, 0.0
        for t, steps, pid in rows:
            if last_pid is not None and pid != last_pid:
                offset += last_steps
            last_pid, last_steps = pid, steps
            curve.append((t, offset + steps))
        out[rank] = curve
    return out


def _at(curve: list[tuple[float, float]], t: float) -> float | None:
    ts = [p[0] for p in curve]
    i = bisect_right(ts, t)
    if i == 0:
        return None
    if i == len(curve):
        return curve[-1][1]
    (t0, c0), (t1, c1) = curve[i - 1], curve[i]
    return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1


def window_rates(curves: dict[int, list], t0: float, window_s: float, n_windows: int) -> dict[int, list]:
    """rank -> step rate (steps/s) per grid window; None before the rank's first progress point."""
    out = {}
    for rank, curve in curves.items():
        rates = []
        for k in range(n_windows):
            a, b = t0 + k * window_s, t0 + (k + 1) * window_s
            ca, cb = _at(curve, a), _at(curve, b)
            rates.append(None if ca is None or cb is None else (cb - ca) / window_s)
        out[rank] = rates
    return out


def fault_impact(rates: dict[int, list], window_s: float, intervals, ranks, quiet_before: set[int],
                 onset_windows: int = 1) -> dict:
    """Impact of one fault on `ranks`: mean rate in the windows inside its bursts (after the
    onset window) against the mean rate in `quiet_before` (windows before it with no fault)."""
    inside = set()
    for a, b in intervals:
        k0, k1 = math.floor(a / window_s + 1e-9) + onset_windows, math.floor(b / window_s + 1e-9)
        inside |= set(range(k0, k1))
    before = [v for r in ranks for k in sorted(quiet_before) if k < len(rates.get(r, []))
              and (v := rates[r][k]) is not None]
    during = [v for r in ranks for k in sorted(inside) if k < len(rates.get(r, []))
              and (v := rates[r][k]) is not None]
    out = {"rate_before": None, "rate_during": None, "impact_pct": None, "effect": None,
           "windows_before": len(before), "windows_during": len(during)}
    if len(before) < 2 or not during:
        out["effect"] = None  # not measured: say so, and score the fault as the file says
        return out
    mb, md = statistics.fmean(before), statistics.fmean(during)
    out["rate_before"], out["rate_during"] = round(mb, 3), round(md, 3)
    if mb <= 0:
        return out
    impact = 100.0 * (md - mb) / mb
    noise = 100.0 * statistics.stdev(before) / mb / math.sqrt(len(during))
    out["impact_pct"] = round(impact, 2)
    out["noise_pct"] = round(noise, 2)
    out["effect"] = -impact >= max(MIN_IMPACT_PCT, NOISE_FACTOR * noise)   # a slowdown only (see above)
    return out

"""Paired overhead measurement: steps/s from progress points, ratios to a base setup within the same round,
and the per-setup summary that benchmarks/ddp_overhead_bench.py writes. Rounds rotate the order of setups, and
every ratio compares setups of one round, because these machines are shared and noisy."""
from __future__ import annotations

import statistics

BASE = "agent_off"
GOAL_SLOWDOWN_PCT = 2.0


def rate_between(points: list[tuple[float, int]], t0: float, t1: float) -> tuple[float, int, float] | None:
    """(steps/s, steps, seconds) between the first and last progress point (t, steps) in [t0, t1]."""
    inside = [p for p in points if t0 <= p[0] <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (ta, sa), (tb, sb) = inside[0], inside[-1]
    return (sb - sa) / (tb - ta), sb - sa, tb - ta


def paired_ratios(rounds: list[dict[str, float]], base: str = BASE) -> dict[str, list[float]]:
    """Per setup, its value over the base setup's value in the same round (rounds where both exist)."""
    out: dict[str, list[float]] = {}
    for values in rounds:
        b = values.get(base)
        if not b:
            continue
        for name, v in values.items():
            if v is not None:
                out.setdefault(name, []).append(v / b)
    return out


def rotated(setups: tuple[str, ...], round_index: int) -> list[str]:
    k = round_index % len(setups)
    return list(setups[k:] + setups[:k])


def summarise(blocks: list[dict], goal_pct: float = GOAL_SLOWDOWN_PCT) -> dict:
    """Per setup: medians over its blocks and the paired (same-round) ratios to agent_off."""
    n_rounds = 1 + max((b["round"] for b in blocks), default=-1)
    by_round = [{b["setup"]: b for b in blocks if b["round"] == r} for r in range(n_rounds)]
    rate = paired_ratios([{s: b["steps_per_s"] for s, b in rd.items()} for rd in by_round])
    # CPU per step: the base's over the setup's, so that below 1 means slower, like the rate ratio
    cpu = paired_ratios([{s: 1 / b["rank_cpu_ms_per_step"] for s, b in rd.items() if b.get("rank_cpu_ms_per_step")}
                         for rd in by_round])
    out = {}
    for name in dict.fromkeys(b["setup"] for b in blocks):
        mine = [b for b in blocks if b["setup"] == name and b.get("steps_per_s") is not None]
        if not mine:
            continue
        rs = rate.get(name, [])
        s = {"blocks": len(mine),
             "steps_per_s_median": round(statistics.median(b["steps_per_s"] for b in mine), 3),
             "steps_per_s_blocks": [round(b["steps_per_s"], 3) for b in mine],
             "ratio_to_agent_off_per_round": [round(r, 4) for r in rs],
             "ratio_to_agent_off": round(statistics.median(rs), 4) if rs else None,
             "slowdown_pct": round(100 * (1 - statistics.median(rs)), 2) if rs else None}
        cpus = [b["rank_cpu_ms_per_step"] for b in mine if b.get("rank_cpu_ms_per_step")]
        if cpus:
            s["rank_cpu_ms_per_step_median"] = round(statistics.median(cpus), 3)
            cr = cpu.get(name, [])
            s["cpu_per_step_ratio_per_round"] = [round(r, 4) for r in cr]
            s["cpu_per_step_slowdown_pct"] = round(100 * (1 - statistics.median(cr)), 2) if cr else None
        agent = [b["agent"]["cpu_pct"] for b in mine if b.get("agent")]
        if agent:
            s["agent_cpu_pct_median"] = round(statistics.median(agent), 2)
            s["agent_cpu_pct_blocks"] = agent
        if name == "full_tracing" and s["slowdown_pct"] is not None:
            s["meets_goal"] = s["slowdown_pct"] <= goal_pct
        out[name] = s
    return out

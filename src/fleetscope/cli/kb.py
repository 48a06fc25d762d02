"""CLI for diagnosis: `kb list|show|replay`, `diagnose`, `remediate`.

`register(subparsers)` adds the commands to fleetscope's parser; each handler
takes (args, cfg). Reading goes through the store with parameterized SQL;
`remediate` is a dry run unless --execute is given together with an explicit
--allow-entry and --allow-host for what may run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fleetscope.cli.common import load_config, open_configured_store, parse_params
from fleetscope.cli.since import iso_utc as _iso, parse_since



def register(subparsers) -> None:
    kb = subparsers.add_parser("kb", help="the knowledge base of known inefficiencies (kb/*.yaml)")
    kb.add_argument("--kb-dir", help="knowledge-base folder (default: the repository's kb/)")
    kb_sub = kb.add_subparsers(dest="kb_command", required=True)
    kb_sub.add_parser("list", help="one line per entry").set_defaults(func=_with_cfg(cmd_kb_list))
    show = kb_sub.add_parser("show", help="one entry in full")
    show.add_argument("name", help="the entry's name, as `kb list` shows it")
    show.set_defaults(func=_with_cfg(cmd_kb_show))
    from fleetscope.cli.kb_replay import register as register_replay
    register_replay(kb_sub, _selection, _with_cfg)

    diag = subparsers.add_parser("diagnose", help="what happened to a job: diagnoses ranked, with evidence")
    _selection(diag)
    diag.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    diag.set_defaults(func=_with_cfg(cmd_diagnose))

    rem = subparsers.add_parser("remediate", help="plan (dry run, the default) or run a job's remediations")
    _selection(rem)
    rem.add_argument("--kb-dir", help="knowledge-base folder (default: the repository's kb/)")
    rem.add_argument("--entry", help="only this KB entry")
    rem.add_argument("--rank", type=int, help="only this rank")
    rem.add_argument("--min-confidence", type=float, default=0.5, help="skip weaker diagnoses (default 0.5)")
    mode = rem.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", default=True, help="say what would run (default)")
    mode.add_argument("--execute", action="store_true", help="run opted-in actions on this host")
    rem.add_argument("--allow-entry", action="append", default=[], metavar="ENTRY",
                     help="opt this KB entry in for --execute (repeat per entry)")
    rem.add_argument("--allow-host", action="append", default=[], metavar="HOST",
                     help="opt this host in for --execute (repeat per host)")
    rem.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                     help="a command parameter, e.g. pid=4242 numa_node=1 gpu=0 irq=142 cpus=0-3")
    rem.add_argument("--operator", default="", help="who asked (stored in the log)")
    rem.set_defaults(func=_with_cfg(cmd_remediate))


def _selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", required=True, help="the job's name, as its ranks report it")
    p.add_argument("--tenant", help="only this tenant (default: every tenant with this job name)")
    p.add_argument("--since", default="24h", help="a duration back from now (30m, 6h, 7d) or an ISO time; default 24h")
    p.add_argument("--limit", type=int, default=50, help="at most this many diagnoses (default 50)")


def _with_cfg(handler):
    def run(args) -> int:
        return handler(args, load_config(args))
    run.__name__ = handler.__name__
    return run


def _open_store(cfg):
    return open_configured_store(cfg)


def _kb(args):
    from fleetscope.streams.diagnosis.kb import KB_DIR, load_kb
    return load_kb(Path(args.kb_dir) if getattr(args, "kb_dir", None) else KB_DIR)


# ---- kb list / show --------------------------------------------------------------

def cmd_kb_list(args, cfg) -> int:
    for name, e in sorted(_kb(args).items()):
        r = e.remediation
        print(f"{name:34} risk={r.risk:6} auto={'yes' if r.auto else 'no ':3}  {e.description.split('.')[0]}.")
        if not e.reachable:
            print(f"{'':34} not reachable yet: waits for {', '.join(e.missing)}")
    return 0


def cmd_kb_show(args, cfg) -> int:
    from fleetscope.streams.diagnosis.subsystems import SUBSYSTEMS
    kb = _kb(args)
    e = kb.get(args.name)
    if e is None:
        print(f"no KB entry {args.name!r}; known: {', '.join(sorted(kb))}", file=sys.stderr)
        return 1
    r = e.remediation
    pattern = ", ".join(f"{s} {v:+.2f}" for s, v in zip(SUBSYSTEMS, e.fingerprint) if v)
    print(f"{e.name}  ({e.path})\n\n{e.description}\n")
    print(f"fingerprint: {pattern}")
    print("rules: all of: " + ("; ".join(c.describe() for c in e.all_rules) or "-"))
    if e.any_rules:
        print("       any of: " + "; ".join(c.describe() for c in e.any_rules))
    for b in e.alternatives:
        print("   or: all of: " + ("; ".join(c.describe() for c in b.all_rules) or "-")
              + ("; any of: " + "; ".join(c.describe() for c in b.any_rules) if b.any_rules else ""))
        if b.remediation is not None:
            print("       where it held, remediation: " + _remediation_text(b.remediation, " " * 9))
    if e.unless_rules:
        print("       not where: " + "; ".join(c.describe() for c in e.unless_rules))
    if e.support_rules:
        print("       surer where: " + "; ".join(c.describe() for c in e.support_rules))
    print(f"evidence: {', '.join(e.evidence)}")
    if not e.reachable:
        print(f"not reachable yet: the pipeline computes no {', '.join(e.missing)}")
    print("remediation: " + _remediation_text(r))
    return 0


def _remediation_text(r, indent: str = "  ") -> str:
    """A remediation as `kb show` prints it: the action, then its risk, check and parameters, each indented."""
    action = f"write {r.write_value!r} to {r.write_path}" if r.kind == "write" else " ".join(r.argv)
    text = f"{action}\n{indent}risk {r.risk}, auto {'yes' if r.auto else 'no'}" + (
        f", requires {', '.join(r.requires)}" if r.requires else "")
    if r.check:
        text += f"\n{indent}evidence check: {' '.join(r.check)}"
    if r.placeholders():
        text += f"\n{indent}parameters: {', '.join(r.placeholders())}"
    return text


# ---- diagnose ----------------------------------------------------------------------

DIAGNOSE_SQL = """
SELECT kb_entry, count() AS windows, uniqExact(rank) AS ranks, max(confidence) AS max_confidence,
       avg(confidence) AS mean_confidence, arraySort(groupUniqArray(16)(rank)) AS rank_list,
       arraySort(groupUniqArray(8)(host)) AS hosts,
       toUnixTimestamp64Milli(min(window_start)) AS first_ms, toUnixTimestamp64Milli(max(window_start)) AS last_ms,
       argMax(evidence, confidence) AS best_evidence, argMax(rank, confidence) AS best_rank,
       argMax(host, confidence) AS best_host, max(score) AS max_score
FROM diagnoses FINAL
WHERE job = {job:String} AND window_start >= fromUnixTimestamp64Milli({since_ms:Int64}) {tenant_clause}
GROUP BY kb_entry
ORDER BY max_confidence DESC, windows DESC, kb_entry
LIMIT {limit:UInt32}
"""


def diagnose_summary(store, job: str, since_ms: int, tenant: str | None = None, limit: int = 50) -> list[dict]:
    """Per KB entry: windows, ranks, confidence, time span and the strongest window's evidence."""
    params = {"job": job, "since_ms": int(since_ms), "limit": int(limit)}
    clause = ""
    if tenant:
        clause, params["tenant"] = "AND tenant = {tenant:String}", tenant
    return store.query(DIAGNOSE_SQL.replace("{tenant_clause}", clause), params).as_dicts()


ROLES_SQL = """
SELECT rank, any(host) AS host, role, count() AS windows
FROM anomalies FINAL
WHERE job = {job:String} AND window_start >= fromUnixTimestamp64Milli({since_ms:Int64}) {tenant_clause}
GROUP BY rank, role
ORDER BY rank, windows DESC
"""


def flagged_roles(store, job: str, since_ms: int, tenant: str | None = None) -> list[dict]:
    """Per flagged rank and role (culprit, waiting, node, job): its host and how many windows."""
    params = {"job": job, "since_ms": int(since_ms)}
    clause = ""
    if tenant:
        clause, params["tenant"] = "AND tenant = {tenant:String}", tenant
    return store.query(ROLES_SQL.replace("{tenant_clause}", clause), params).as_dicts()


def roles_lines(roles: list[dict]) -> list[str]:
    """The culprit(s) named, then every flagged rank with its role(s)."""
    culprits = sorted({r["rank"] for r in roles if r["role"] == "culprit"})
    lines = [f"culprit: rank {','.join(map(str, culprits))}" if culprits else "culprit: none named"]
    by_rank: dict[int, list[dict]] = {}
    for r in roles:
        by_rank.setdefault(r["rank"], []).append(r)
    for rank, rs in sorted(by_rank.items()):
        what = ", ".join(f"{r['role'] or 'unlabelled'} in {r['windows']} windows" for r in rs)
        lines.append(f"  rank {rank} on {rs[0]['host']}: {what}")
    return lines


def with_roles(rows: list[dict], roles: list[dict]) -> list[dict]:
    """The JSON rows (one per KB entry, keys unchanged) with the job's culprits and roles added to each:
    ``culprit_ranks`` (the job's, over the span), ``rank_roles`` (each of this entry's ranks: its roles,
    most windows first) and ``flagged_ranks`` (every flagged rank of the job, waiting ones too, with
    host, role and windows)."""
    culprits = sorted({r["rank"] for r in roles if r["role"] == "culprit"})
    by_rank: dict[int, list[str]] = {}
    for r in roles:   # ordered by rank, then windows, most first
        by_rank.setdefault(r["rank"], []).append(r["role"])
    flagged = [{"rank": r["rank"], "host": r["host"], "role": r["role"], "windows": r["windows"]} for r in roles]
    return [{**row, "culprit_ranks": culprits,
             "rank_roles": {str(rank): by_rank.get(rank, []) for rank in row["rank_list"]},
             "flagged_ranks": flagged} for row in rows]


def cmd_diagnose(args, cfg) -> int:
    since_ms = parse_since(args.since)
    store = _open_store(cfg)
    try:
        rows = diagnose_summary(store, args.job, since_ms, args.tenant, args.limit)
        roles = flagged_roles(store, args.job, since_ms, args.tenant)
    finally:
        store.close()
    if args.format == "json":
        print(json.dumps(with_roles(rows, roles), default=str, indent=1))
        return 0
    if not rows:
        print(f"no diagnoses for job {args.job} since {_iso(since_ms)}")
        return 0
    print(f"job {args.job}: {len(rows)} diagnoses since {_iso(since_ms)} UTC, most confident first\n")
    print("\n".join(roles_lines(roles)) + "\n")
    for i, r in enumerate(rows, 1):
        ranks = ",".join(str(x) for x in r["rank_list"]) + ("..." if r["ranks"] > len(r["rank_list"]) else "")
        print(f"{i}. {r['kb_entry']}  confidence {r['max_confidence']:.2f} max, {r['mean_confidence']:.2f} mean; "
              f"{r['windows']} windows, ranks {ranks} on {','.join(r['hosts'])}")
        print(f"   from {_iso(r['first_ms'])} to {_iso(r['last_ms'])} UTC; highest score {r['max_score']:.4g}")
        evidence = ", ".join(f"{k}={_num(v)}" for k, v in sorted(r["best_evidence"].items()))
        print(f"   evidence (rank {r['best_rank']} on {r['best_host']}): {evidence}\n")
    return 0


# ---- remediate ---------------------------------------------------------------------

TARGETS_SQL = """
SELECT kb_entry, host, rank, argMax(tenant, confidence) AS best_tenant, max(confidence) AS best_confidence,
       toUnixTimestamp64Nano(argMax(window_start, confidence)) AS window_ns,
       argMax(evidence, confidence) AS best_evidence, argMax(rules_held, confidence) AS best_rules_held
FROM diagnoses FINAL
WHERE job = {job:String} AND kb_entry != 'unmatched' AND confidence >= {min_conf:Float32}
  AND window_start >= fromUnixTimestamp64Milli({since_ms:Int64}) {extra}
GROUP BY kb_entry, host, rank
ORDER BY best_confidence DESC, kb_entry, host, rank
LIMIT {limit:UInt32}
"""


def remediation_targets(store, job: str, since_ms: int, tenant: str | None = None, entry: str | None = None,
                        rank: int | None = None, min_confidence: float = 0.5, limit: int = 50) -> list[dict]:
    params = {"job": job, "since_ms": int(since_ms), "min_conf": float(min_confidence), "limit": int(limit)}
    extra = []
    if tenant:
        extra.append("AND tenant = {tenant:String}")
        params["tenant"] = tenant
    if entry:
        extra.append("AND kb_entry = {entry:String}")
        params["entry"] = entry
    if rank is not None:
        extra.append("AND rank = {rank:Int32}")
        params["rank"] = int(rank)
    return store.query(TARGETS_SQL.replace("{extra}", " ".join(extra)), params).as_dicts()


def cmd_remediate(args, cfg, executor=None) -> int:
    """Plan every diagnosed (entry, host, rank); run only what policy allows; log all of it."""
    from fleetscope.streams.diagnosis.records import remediation_log_columns
    from fleetscope.streams.diagnosis.remediation import (LocalExecutor, Policy, RemediationError,
                                                          check_operator_params, plan, render, run_action)

    kb = _kb(args)
    params = parse_params(args.param)
    try:
        check_operator_params(params)
    except RemediationError as exc:
        print(f"fleetscope remediate: {exc}", file=sys.stderr)
        return 2
    policy = Policy(execute=bool(args.execute), allowed_entries=frozenset(args.allow_entry),
                    allowed_hosts=frozenset(args.allow_host))
    if args.execute and not (args.allow_entry and args.allow_host):
        print("--execute runs nothing unless you also name what may run: --allow-entry ENTRY and --allow-host HOST",
              file=sys.stderr)
    executor = executor or LocalExecutor(cfg.host)
    store = _open_store(cfg)

    def journal(rec) -> None:
        # One row per record, written at once: the intent lands before anything runs.
        store.insert("remediation_log", remediation_log_columns([rec]),
                     dedupe_token=f"remediate-{rec.record_id}-{rec.status}")

    try:
        targets = remediation_targets(store, args.job, parse_since(args.since), args.tenant, args.entry, args.rank,
                                      args.min_confidence, args.limit)
        records, unknown = [], []
        for t in targets:
            entry = kb.get(t["kb_entry"])
            if entry is None:
                unknown.append(t["kb_entry"])
                continue
            action = plan(entry, tenant=t["best_tenant"], job=args.job, host=t["host"], rank=t["rank"],
                          window_start_ns=t["window_ns"], params=params, evidence=t["best_evidence"],
                          held=t["best_rules_held"])
            rec = run_action(action, policy, executor, operator=args.operator, journal=journal)
            records.append(rec)
            print(f"{render(action, rec)}\n  confidence {t['best_confidence']:.2f}\n")
    finally:
        store.close()
    if unknown:
        print(f"skipped {len(unknown)} diagnoses whose KB entry is gone: {', '.join(sorted(set(unknown)))}",
              file=sys.stderr)
    if not targets:
        print(f"nothing to remediate for job {args.job} (no matched diagnosis at confidence >= {args.min_confidence})")
    counts = {s: sum(r.status == s for r in records) for s in ("planned", "refused", "ok", "failed")}
    print("logged: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) if records else "logged: nothing")
    return 1 if counts["failed"] else 0


# ---- helpers -----------------------------------------------------------------------

def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)

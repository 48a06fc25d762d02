"""`fleetscope kb replay`: a job's stored anomalies diagnosed again with a knowledge base (an edited one).

    fleetscope kb --kb-dir ./my-kb replay --job train --since 6h

Per rank: the top entries stored when the windows were flagged, and those the given KB names; then the windows
whose top entry changes. Read-only (streams/diagnosis/replay.py).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path


def register(kb_sub, selection, with_cfg) -> None:
    p = kb_sub.add_parser("replay", help="diagnose a job's stored anomalies again with this KB (try an edit first)")
    selection(p)
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    p.set_defaults(func=with_cfg(cmd_kb_replay))


def cmd_kb_replay(args, cfg) -> int:
    from fleetscope.cli.common import open_configured_store
    from fleetscope.cli.since import iso_utc as _iso, parse_since
    from fleetscope.streams.diagnosis.kb import KB_DIR, load_kb
    from fleetscope.streams.diagnosis.replay import replay
    since_ms = parse_since(args.since)
    kb = load_kb(Path(args.kb_dir) if getattr(args, "kb_dir", None) else KB_DIR)
    store = open_configured_store(cfg)
    try:
        result = replay(store, kb, args.job, since_ms, args.tenant)
    finally:
        store.close()
    changed = result.changed
    if args.format == "json":
        print(json.dumps({"job": args.job, "since": _iso(since_ms), "anomalies": len(result.rows),
                          "changed": len(changed),
                          "by_rank": {str(rank): {k: dict(c) for k, c in d.items()}
                                      for rank, d in result.by_rank().items()},
                          "changes": [{"tenant": r.tenant, "host": r.host, "rank": r.rank,
                                       "window_start": _iso(r.window_ns // 10**6), "role": r.role,
                                       "stored": r.stored, "replayed": r.replayed,
                                       "confidence": round(r.confidence, 4)} for r in changed[:args.limit]]},
                         indent=1))
        return 0
    if not result.rows:
        print(f"no alerted anomalies for job {args.job} since {_iso(since_ms)} UTC")
        return 0
    print(f"job {args.job}: {len(result.rows)} alerted anomalies since {_iso(since_ms)} UTC; "
          f"the top entry changes in {len(changed)}\n")
    for rank, d in result.by_rank().items():
        print(f"rank {rank}\n  stored:   {_counts(d['stored'])}\n  replayed: {_counts(d['replayed'])}")
    if changed and args.limit > 0:
        print(f"\nchanged windows (first {min(len(changed), args.limit)}):")
        for r in changed[:args.limit]:
            print(f"  {_iso(r.window_ns // 10**6)} rank {r.rank} on {r.host} ({r.role or 'no role'}): "
                  f"{r.stored or '(none stored)'} -> {r.replayed} ({r.confidence:.2f})")
    return 0


def _counts(c: Counter) -> str:
    return ", ".join(f"{name} {n}" for name, n in c.most_common())

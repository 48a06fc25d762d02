"""Expand the ClickHouse Grafana datasource's macros and dashboard variables to concrete SQL, as the plugin
(grafana-clickhouse-datasource 4.x) and Grafana do before a query reaches ClickHouse:

  $__timeFilter(col)   col >= toDateTime(FROM) AND col <= toDateTime(TO)   (FROM, TO: Unix seconds)
  $__timeInterval(col) toStartOfInterval(toDateTime(col), INTERVAL N second)
  $__fromTime          toDateTime(FROM)
  $__toTime            toDateTime(TO)
  $__interval_s        N
  ${name:sqlstring}    the value quoted as an SQL string, quotes doubled (Grafana's sqlstring format)
  ${name}, $name       the value as is

Anything left that looks like a macro or a variable is an error: a panel must not reach ClickHouse with one.
"""
from __future__ import annotations

import re


def expand(sql: str, from_s: int, to_s: int, interval_s: int, variables: dict[str, str]) -> str:
    out = re.sub(r"\$__timeFilter\(\s*([A-Za-z_][A-Za-z0-9_.]*)\s*\)",
                 lambda m: f"{m[1]} >= toDateTime({from_s}) AND {m[1]} <= toDateTime({to_s})", sql)
    out = re.sub(r"\$__timeInterval\(\s*([A-Za-z_][A-Za-z0-9_.]*)\s*\)",
                 lambda m: f"toStartOfInterval(toDateTime({m[1]}), INTERVAL {interval_s} second)", out)
    out = out.replace("$__fromTime", f"toDateTime({from_s})").replace("$__toTime", f"toDateTime({to_s})")
    out = out.replace("$__interval_s", str(interval_s))

    def var(m: re.Match) -> str:
        name, fmt = m["name"] or m["bare"], m["fmt"]
        if name not in variables:
            raise KeyError(f"dashboard variable {name!r} has no value")
        value = variables[name]
        if fmt == "sqlstring":
            return "'" + value.replace("'", "''") + "'"
        if fmt:
            raise ValueError(f"variable format {fmt!r} is not expanded here")
        return value

    out = re.sub(r"\$\{(?P<name>[A-Za-z_]\w*)(?::(?P<fmt>\w+))?\}|\$(?P<bare>[A-Za-z_]\w*)", var, out)
    if "$" in out:
        raise ValueError(f"unexpanded macro left in: {out}")
    return out

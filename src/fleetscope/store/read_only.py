"""The query door's guard: what `fleetscope query` and the endpoint's /query may run.

Two layers, because neither is enough alone. Measured on chDB 4.4 (ClickHouse 26.9):
- The engine's `readonly=1` refuses DDL, DML, SET, a SETTINGS clause, and the
  table functions file(), url(), remote(), executable(), Python(). But it still
  ran `SELECT file('/etc/hostname')` (the scalar file() reads a file),
  `SELECT 1 INTO OUTFILE '/x'` (the file was written), `DESCRIBE file(...)`,
  `KILL QUERY` (which could cancel the worker's inserts), `USE system`, and the
  first statement of `SELECT 1; SELECT 2`.
- `readonly=2` (what a server connection gets, so that max_execution_time can
  travel with each query) lets table functions through: file() read,
  url() made its request, INSERT INTO FUNCTION file() wrote.

check_read_only refuses all of that before the engine sees the statement; the
engine's read-only mode stays on underneath in case the guard misses something.

The guard reads the SQL with its own small lexer. Where it could read text
differently from ClickHouse it errs towards refusing: `#` is not taken as a
comment, comments do not nest, and `$` (heredoc strings) is refused outside
strings, so nothing can hide inside what only one of the two takes for a string.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fleetscope.store.base import StoreError

READ_TIMEOUT_S = 60  # max_execution_time of a query through the door

# The statements the door runs. All of them only read.
READ_STATEMENTS = frozenset({"select", "with", "show", "describe", "desc", "explain", "exists"})

# Keywords that make a read statement do something else: write a file (INTO
# OUTFILE), change settings (SETTINGS), or change the output format we parse.
FORBIDDEN_KEYWORDS = {
    "into": "INTO (e.g. INTO OUTFILE) writes where the door does not let anything write",
    "settings": "a SETTINGS clause could lift the door's limits",
}

# Table functions of the engine that never leave the store's own data (or make
# up rows): these are all the door allows.
HARMLESS_TABLE_FUNCTIONS = frozenset({
    "numbers", "numbers_mt", "zeros", "zeros_mt", "generate_series", "generateseries", "generaterandom",
    "primes", "null", "values", "sqlstandardvalues", "view", "viewifpermitted", "viewexplain", "merge",
    "format", "dictionary",
})

# Every other table function chDB 4.4 knows (system.table_functions), lower-case:
# they reach files, URLs, object stores, other servers or programs, or inspect
# the engine's internals. A test fails when the engine knows one that is in
# neither set, so an upgrade cannot slip a new one through.
REACHING_TABLE_FUNCTIONS = frozenset({
    "arrowstream", "azureblobstorage", "azureblobstoragecluster", "bigquery", "cluster", "clusterallreplicas",
    "cosn", "deltalake", "deltalakeazure", "deltalakeazurecluster", "deltalakecluster", "deltalakelocal",
    "deltalakes3", "deltalakes3cluster", "eval", "executable", "file", "filecluster", "filesystem", "fuzzjson",
    "fuzzquery", "gcs", "hdfs", "hdfscluster", "hudi", "hudicluster", "iceberg", "icebergazure",
    "icebergazurecluster", "icebergcluster", "iceberghdfs", "iceberghdfscluster", "iceberglocal",
    "iceberglocalcluster", "icebergs3", "icebergs3cluster", "input", "jdbc", "loop", "mergetreeanalyzeindexes",
    "mergetreeanalyzeindexesuuid", "mergetreecodecblockcounts", "mergetreeindex", "mergetreeprojection",
    "mergetreetextindex", "mongodb", "mysql", "odbc", "oss", "paimon", "paimonazure", "paimonazurecluster",
    "paimoncluster", "paimonhdfs", "paimonhdfscluster", "paimonlocal", "paimons3", "paimons3cluster",
    "postgresql", "prometheusquery", "prometheusqueryrange", "python", "redis", "remote", "remotesecure", "s3",
    "s3cluster", "sqlite", "timeseriesdata", "timeseriesmetricfamilies", "timeseriesmetrics",
    "timeseriessamples", "timeseriesselector", "timeseriestags", "url", "urlcluster", "ytsaurus",
    # older or server-only names of the same kind
    "executablepool", "hive", "azureblob", "s3queue", "azurequeue", "mysqlreplica",
})

# Ordinary (scalar) functions that read files by path.
REACHING_FUNCTIONS = frozenset({"file", "catboostevaluate", "modelevaluate"})

DENIED_CALLS = REACHING_TABLE_FUNCTIONS | REACHING_FUNCTIONS

HOW_TO = ("the query door is read-only: one SELECT, WITH, SHOW, DESCRIBE, EXPLAIN or EXISTS over the "
          "store's tables, without table functions that reach files, URLs or other servers")


class QueryRefused(StoreError):
    """The door refused a statement before it reached the engine."""


@dataclass(frozen=True)
class Token:
    kind: str    # "word" | "quoted" (a `quoted` or "quoted" identifier) | "string" | "number" | "punct"
    text: str    # words lower-cased; quoted identifiers without their quotes


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"[0-9][0-9A-Za-z_.]*")


def tokens(sql: str) -> list[Token]:
    """The SQL as tokens, without whitespace and comments."""
    out: list[Token] = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c.isspace():
            i += 1
        elif sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
        elif sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            if j < 0:
                raise QueryRefused("query refused: a /* comment is not closed")
            i = j + 2
        elif c in "'`\"":
            j, text = _quoted(sql, i)
            out.append(Token("string" if c == "'" else "quoted", text if c == "'" else text.lower()))
            i = j
        elif c == "$":
            raise QueryRefused("query refused: '$' (heredoc strings) is not accepted by the query door; "
                               "use '...' strings")
        elif m := _WORD.match(sql, i):
            out.append(Token("word", m.group().lower()))
            i = m.end()
        elif m := _NUMBER.match(sql, i):
            out.append(Token("number", m.group()))
            i = m.end()
        else:
            out.append(Token("punct", c))
            i += 1
    return out


def _quoted(sql: str, start: int) -> tuple[int, str]:
    """(index after the closing quote, the text inside) of the quoted run at start."""
    q = sql[start]
    j, n, buf = start + 1, len(sql), []
    while j < n:
        c = sql[j]
        if c == "\\" and j + 1 < n:
            buf.append(sql[j + 1])
            j += 2
        elif c == q and j + 1 < n and sql[j + 1] == q:  # a doubled quote is an escaped one
            buf.append(q)
            j += 2
        elif c == q:
            return j + 1, "".join(buf)
        else:
            buf.append(c)
            j += 1
    raise QueryRefused(f"query refused: a {q} quote is not closed")


def check_read_only(sql: str) -> None:
    """Raise QueryRefused, saying why, unless sql is one statement that only reads the store."""
    if not isinstance(sql, str) or not sql.strip():
        raise QueryRefused("query refused: no SQL given")
    toks = tokens(sql)
    while toks and toks[-1] == Token("punct", ";"):
        toks.pop()
    if not toks:
        raise QueryRefused("query refused: no SQL given")
    if Token("punct", ";") in toks:
        raise QueryRefused(f"query refused: one statement at a time ({HOW_TO})")
    first = next((t for t in toks if t != Token("punct", "(")), toks[0])
    if first.kind != "word" or first.text not in READ_STATEMENTS:
        raise QueryRefused(f"query refused: {first.text.upper()} statements are not allowed ({HOW_TO})")
    for k, tok in enumerate(toks):
        following = toks[k + 1] if k + 1 < len(toks) else None
        calls = following == Token("punct", "(")
        if tok.kind in ("word", "quoted") and calls and tok.text in DENIED_CALLS:
            raise QueryRefused(f"query refused: {tok.text}() reaches files, URLs, other servers or programs "
                               f"({HOW_TO})")
        if tok.kind == "word" and not calls and tok.text in FORBIDDEN_KEYWORDS:
            raise QueryRefused(f"query refused: {FORBIDDEN_KEYWORDS[tok.text]} ({HOW_TO})")
        if tok.kind == "word" and tok.text == "format" and not calls:
            raise QueryRefused("query refused: a FORMAT clause is not accepted; choose the output with --format")

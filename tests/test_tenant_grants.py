"""`fleetscope tenants grant|revoke`: the statements a ClickHouse server would run.

No ClickHouse server can run on these machines (Debian has only 18.16; no registry carries a newer one), so
the statements are not executed. They are checked here: derived from the real migrations, compared with the
real schema that chDB builds from them, and parsed by ClickHouse's own parser (chDB's `EXPLAIN AST`). chDB has
no users, roles or row policies, so the command refuses to run against it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import chdb
import pytest

from fleetscope.store.tenant_grants import (UNRESTRICTED_POLICY, TenantError, check_tenant, grant_statements,
                                            password_sha256, quote_string, revoke_statements, tenant_tables)

HASH = password_sha256("correct horse")
CLI = [sys.executable, "-m", "fleetscope"]


def clickhouse_ast(statement: str) -> str:
    return str(chdb.query("EXPLAIN AST " + statement, "TSVRaw"))


def clickhouse_format(statement: str) -> str:
    """The statement as ClickHouse's parser understood it, printed back (formatQuery)."""
    return str(chdb.query("SELECT formatQuery({q:String})", "TSVRaw", params={"q": statement})).strip()


def test_the_tables_granted_are_exactly_those_with_a_tenant_column_in_the_migrated_schema(store):
    """The list comes from the migrations' text; the truth is the schema chDB built from the same migrations."""
    with_tenant = {row[0] for row in store.query(
        "SELECT table FROM system.columns WHERE database = {db:String} AND name = 'tenant'",
        {"db": store.database}).rows}
    assert set(tenant_tables(store.database)) == with_tenant
    assert {"raw_metrics", "features", "scores", "anomalies", "diagnoses"} <= with_tenant
    assert "dlq" not in with_tenant and "schema_migrations" not in with_tenant


def test_grant_covers_every_tenant_table_once_and_nothing_else():
    tables = tenant_tables("fleetscope")
    statements = grant_statements("team-a", "fleetscope", tables, ["other"], HASH)
    for table in tables:
        on = f"ON `fleetscope`.`{table}` "
        assert sum(s.startswith("CREATE ROW POLICY OR REPLACE `fleetscope_tenant_team-a` " + on) for s in statements) == 1
        assert sum(s.startswith(f"CREATE ROW POLICY OR REPLACE `{UNRESTRICTED_POLICY}` " + on) for s in statements) == 1
        assert sum(s == f"GRANT SELECT {on}TO `fleetscope_tenant_team-a_reader`" for s in statements) == 1
    granted = {m.group(1) for s in statements for m in [re.match(r"GRANT SELECT ON `fleetscope`\.`(\w+)`", s)] if m}
    assert granted == set(tables)  # no `db.*`: a table a later migration adds is not readable without its policy
    assert all("tenant = 'team-a'" in s for s in statements if "`fleetscope_tenant_team-a` ON" in s)


def test_grant_puts_the_filters_in_place_before_the_tenant_may_select():
    statements = grant_statements("team-a", "fleetscope", tenant_tables("fleetscope"), [], HASH)
    kinds = ["unrestricted" if UNRESTRICTED_POLICY in s else "policy" if "ROW POLICY" in s
             else "select" if s.startswith("GRANT SELECT") else "setup" for s in statements]
    assert kinds == sorted(kinds, key=["setup", "unrestricted", "policy", "select"].index)
    # everyone but the tenants keeps seeing every row: the workers, migrations, Grafana's own user
    unrestricted = next(s for s in statements if UNRESTRICTED_POLICY in s)
    assert unrestricted.endswith("USING 1 AS PERMISSIVE TO ALL EXCEPT `fleetscope_tenant_team-a`, "
                                 "`fleetscope_tenant_team-a_reader`")


def test_other_tenants_stay_excepted_from_the_unrestricted_policy():
    statements = grant_statements("b", "fleetscope", ["features"], ["a", "c"], HASH)
    unrestricted = next(s for s in statements if UNRESTRICTED_POLICY in s)
    for t in ("a", "b", "c"):
        assert f"`fleetscope_tenant_{t}`, `fleetscope_tenant_{t}_reader`" in unrestricted


def test_revoke_removes_the_user_first_and_the_unrestricted_policy_with_the_last_tenant():
    tables = tenant_tables("fleetscope")
    statements = revoke_statements("team-a", "fleetscope", tables, ["other"])
    assert statements[0] == "DROP USER IF EXISTS `fleetscope_tenant_team-a`"
    assert "DROP ROLE IF EXISTS `fleetscope_tenant_team-a_reader`" in statements
    for table in tables:
        assert f"DROP ROW POLICY IF EXISTS `fleetscope_tenant_team-a` ON `fleetscope`.`{table}`" in statements
    rewritten = [s for s in statements if UNRESTRICTED_POLICY in s]
    assert len(rewritten) == len(tables) and all("team-a" not in s and "`fleetscope_tenant_other`" in s
                                                 for s in rewritten)
    last = revoke_statements("team-a", "fleetscope", tables, [])
    assert [s for s in last if UNRESTRICTED_POLICY in s] == [
        f"DROP ROW POLICY IF EXISTS `{UNRESTRICTED_POLICY}` ON `fleetscope`.`{t}`" for t in tables]


def test_every_statement_parses_in_clickhouse_and_the_tenant_is_one_string_literal():
    tables = tenant_tables("fleetscope")
    for tenant in ("team-a", "ml.research", "Slurm_acct7"):
        for statement in (grant_statements(tenant, "fleetscope", tables, ["x"], HASH)
                          + revoke_statements(tenant, "fleetscope", tables, ["x"])):
            clickhouse_ast(statement)  # raises on a syntax error
            if "USING tenant" in statement:
                assert f" USING tenant = '{tenant}' TO `fleetscope_tenant_{tenant}_reader`".replace("`", "") in \
                    clickhouse_format(statement).replace("`", "")


@pytest.mark.parametrize("tenant", ["a'b", "a`b", "a b", "", "-lead", "x" * 64, "a\\b", "a;b", "ünï", "a\nb", None])
def test_a_tenant_that_could_escape_its_quoting_is_refused_before_any_statement(tenant):
    with pytest.raises(TenantError, match="invalid tenant"):
        grant_statements(tenant, "fleetscope", ["features"], [], HASH)
    with pytest.raises(TenantError, match="invalid tenant"):
        revoke_statements(tenant, "fleetscope", ["features"], [])


def test_string_quoting_survives_clickhouses_parser():
    """Belt and braces under the tenant check: the quoting itself keeps a hostile value one literal."""
    value = "it's \\ a 'trap') OR 1 --"
    ast = clickhouse_ast(f"SELECT {quote_string(value)} AS v")
    assert ast.count("Literal") == 1


def test_the_password_is_sent_only_as_its_hash():
    statements = grant_statements("team-a", "fleetscope", ["features"], [], HASH)
    assert not any("correct horse" in s for s in statements)
    assert f"IDENTIFIED WITH sha256_hash BY '{HASH}'" in statements[1]
    with pytest.raises(TenantError):
        grant_statements("team-a", "fleetscope", ["features"], [], "' OR 1")
    assert check_tenant("team-a") == "team-a"


def run_cli(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_CLICKHOUSE")}
    env["FLEETSCOPE_DATA_DIR"] = str(tmp_path)
    return subprocess.run(CLI + args, env=env, capture_output=True, text=True, timeout=120)


def test_grant_against_the_embedded_chdb_is_refused_with_what_to_do(tmp_path):
    done = run_cli(["tenants", "grant", "team-a"], tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a ClickHouse server (set FLEETSCOPE_CLICKHOUSE_URL" in lines[0]
    assert "--print" in lines[0]
    assert not (tmp_path / "chdb").exists()  # nothing was opened or created


def test_print_shows_the_statements_without_a_server_and_the_generated_password_once(tmp_path):
    done = run_cli(["tenants", "grant", "team-a", "--print"], tmp_path)
    assert done.returncode == 0, done.stderr
    statements = [s.strip() for s in done.stdout.strip().removesuffix(";").split(";\n")]
    assert len(statements) == 4 + 3 * len(tenant_tables("fleetscope"))
    for statement in statements:
        clickhouse_ast(statement)
    password = re.search(r"\(shown once\): (\S+)", done.stderr).group(1)
    assert password_sha256(password) in done.stdout and password not in done.stdout
    bad = run_cli(["tenants", "revoke", "a'b", "--print"], tmp_path)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("fleetscope: invalid tenant")

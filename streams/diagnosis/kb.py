"""The knowledge base: one YAML file per known inefficiency, in kb/.

A file holds (every field is checked on load; an error names file and field):

    name: numa_misplacement            # equals the file stem; not "unmatched"
    description: what it is and why it costs time
    fingerprint: {host_memory: 0.7, cpu: 0.3}   # signed subsystem weights
    rules:
      all:                             # every condition must hold
        - {feature: numa_miss_ratio, op: ">=", value: 0.1}
      any:                             # optional: at least one must hold
        - {peer_z: numa_miss_ratio, op: ">=", value: 3}
        - {peer_z: nccl_lat_p99_ns, op: ">=", value: 3, abs: false}
      unless:                          # optional: the entry does not apply where one holds
        - {feature: outside_cpu_rise_cores, op: ">=", value: 0.5}
      support:                         # optional: raise the confidence where they hold; never enough alone
        - {peer_z: runq_wait_threads, op: ">=", value: 3}
      or:                              # optional: other ways the same cause shows, each an `all`/`any` block
        - any: [{feature: link_wakeup_ratio, op: ">=", value: 1.2}]
          remediation: {...}           # optional: the block's own (as below), where its cause wants another fix
    evidence: [numa_miss_ratio, ...]   # features to show with a diagnosis
    remediation:
      command: "numactl --cpunodebind={numa_node} --membind={numa_node} -- ..."
      # or  write: {path: "/proc/irq/{irq}/smp_affinity_list", value: "{cpus}"}
      check: "numastat -p {pid}"       # optional, read-only: evidence before/after
      risk: low | medium | high
      auto: false                      # may it run without an operator
      requires: [numactl]              # tools that must exist on the host
    requires: [irq_rank_cpu_share, peer_z.thp_coverage_frac]   # optional: features the entry waits for
    roles: [job, node]                 # optional: the roles of flagged windows it can explain (default: all)

Every feature named in `rules` and `evidence` must be one that a builder emits
(streams/feature_catalogue.py), and a `peer_z` condition needs a feature of the
rank's own vector or one the scorer joins and compares (PEER_Z_FEATURES). An entry whose rules can
never hold with what the pipeline computes loads only if it lists the missing
inputs under `requires:` (a feature, or `peer_z.<feature>`); it is then "not
reachable yet" (``Entry.missing``, shown by `fleetscope kb list`). Anything
else is a load error naming the file and the feature.

A condition reads the window's feature value (`feature`) or its peer z-score
(`peer_z`); `abs: true` compares the magnitude. A masked (absent) input makes
its condition false, unless it says `if_present: true`: then an absent input
holds (a GPU condition that a CPU-only job cannot be asked about). An `unless` condition names what a more
specific entry explains: the entry is no candidate where one holds (a masked input holds none), so a job slowed
by load from outside it is a noisy neighbour, not a job-wide slowdown of unknown cause. A `support` condition
counts toward the confidence like the others but makes no window a candidate: it is what the entry's story also
shows, and what another story shows too (a rank that waits to run more than its peers is a noisy neighbour's
victim only if something else took its host's CPU; alone, it is a straggler). An `or` block is another way the same
cause shows, with its own `all` and `any` (a slow link in a ring shows in no rank's own bandwidth, only in how the rank
behind it wakes): the entry is a candidate where its main block or one of them holds; `unless`, `support` and `roles`
apply to every block. An `or` block may carry its own `remediation` (the same fields): planned for a
diagnosis whose held rules show that block held (``Entry.remediation_for``), the entry's otherwise (a slow TCP
link wants its sockets read, not NVLink's counters). `roles` limits an entry to the windows
whose role (streams/model/roles.py) fits its story: a job-wide slowdown explains the ranks flagged `job`
or `node`, not a culprit whose peers wait for it. `{name}` placeholders in commands are filled per argv
token at plan time (remediation.py), never through a shell.
"""
from __future__ import annotations

import math
import operator
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from fleetscope.resources import package_dir
from fleetscope.streams.diagnosis.fingerprint import pattern_vector
from fleetscope.streams.feature_catalogue import ALL_FEATURES, PEER_Z_FEATURES
from fleetscope.streams.model.roles import ROLES

KB_DIR = package_dir("fleetscope.kb")
UNMATCHED = "unmatched"
NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
PLACEHOLDER_RE = re.compile(r"\{([^{}]*)\}")
PARAM_RE = re.compile(r"^[a-z][a-z0-9_]*$")
OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
    "==": operator.eq, "!=": operator.ne,
}
RISKS = ("low", "medium", "high")


class KBError(ValueError):
    """A KB file is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class Condition:
    source: str       # "feature" | "peer_z"
    name: str
    op: str
    value: float
    use_abs: bool = False
    if_present: bool = False   # an absent input holds

    def read(self, features: Mapping[str, float], peer_z: Mapping[str, float]) -> float | None:
        table = features if self.source == "feature" else peer_z
        v = table.get(self.name)
        if v is None:
            return None
        try:
            v = float(v)
        except (TypeError, ValueError):
            return None
        if not math.isfinite(v):
            return None
        return abs(v) if self.use_abs else v

    def holds(self, features: Mapping[str, float], peer_z: Mapping[str, float]) -> bool:
        v = self.read(features, peer_z)
        if v is None:
            return self.if_present
        return OPS[self.op](v, self.value)

    def describe(self) -> str:
        lhs = f"{self.source}.{self.name}" if self.source == "peer_z" else self.name
        text = f"{'|' + lhs + '|' if self.use_abs else lhs} {self.op} {self.value:g}"
        return f"{text} or absent" if self.if_present else text


@dataclass(frozen=True)
class RuleBlock:
    """One way an entry's cause shows: every `all` condition holds and, if it has any, one `any` condition."""
    all_rules: tuple[Condition, ...]
    any_rules: tuple[Condition, ...]
    remediation: "Remediation | None" = None   # an `or` block's own; None: the entry's

    def held_in(self, held: Sequence[str]) -> bool:
        """Do a match's held rules (Match.held, the store's rules_held) show this block held?"""
        said = set(held)
        return all(c.describe() in said for c in self.all_rules) and (
            not self.any_rules or any(c.describe() in said for c in self.any_rules))


@dataclass(frozen=True)
class Remediation:
    kind: str                  # "command" | "write"
    argv: tuple[str, ...]      # command: argv template tokens
    write_path: str = ""       # write: path template
    write_value: str = ""      # write: value template
    check: tuple[str, ...] = ()  # read-only argv template for evidence
    risk: str = "low"
    auto: bool = False
    requires: tuple[str, ...] = ()

    def placeholders(self) -> list[str]:
        texts = list(self.argv) + [self.write_path, self.write_value] + list(self.check)
        return sorted({m for t in texts for m in PLACEHOLDER_RE.findall(t)})


@dataclass(frozen=True)
class Entry:
    name: str
    description: str
    fingerprint: tuple[float, ...]
    all_rules: tuple[Condition, ...]
    any_rules: tuple[Condition, ...]
    evidence: tuple[str, ...]
    remediation: Remediation
    path: Path = field(default=Path(), compare=False)
    missing: tuple[str, ...] = ()   # inputs its rules wait for (`requires:`): empty when it can match today
    roles: tuple[str, ...] = ROLES  # the roles of flagged windows it can explain
    unless_rules: tuple[Condition, ...] = ()   # where one holds, the entry does not apply
    support_rules: tuple[Condition, ...] = ()  # count toward the confidence where they hold; never decide
    alternatives: tuple[RuleBlock, ...] = ()   # `or`: other blocks, each enough alone

    @property
    def blocks(self) -> tuple[RuleBlock, ...]:
        """The main block first, then the `or` blocks."""
        return (RuleBlock(self.all_rules, self.any_rules), *self.alternatives)

    def remediation_for(self, held: Sequence[str] = ()) -> Remediation:
        """The remediation for a diagnosis whose held rules are ``held``: that of the first block they show held
        (the matcher takes the first block that holds, and held names its conditions), where it has its own;
        else the entry's."""
        for block in self.blocks:
            if block.held_in(held):
                return block.remediation or self.remediation
        return self.remediation

    def explains_role(self, role: str) -> bool:
        """An anomaly without a role (stored before roles existed) fits every entry."""
        return not role or role in self.roles

    @property
    def reachable(self) -> bool:
        return not self.missing


def load_kb(kb_dir: Path | str = KB_DIR) -> dict[str, Entry]:
    """Every kb_dir/*.yaml, validated; all problems are reported together."""
    kb_dir = Path(kb_dir)
    files = sorted(kb_dir.glob("*.yaml"))
    if not files:
        raise KBError(f"{kb_dir}: no *.yaml knowledge-base files")
    entries: dict[str, Entry] = {}
    errors: list[str] = []
    for path in files:
        try:
            entry = load_entry(path)
        except KBError as exc:
            errors.append(str(exc))
            continue
        entries[entry.name] = entry
    if errors:
        raise KBError("invalid knowledge base:\n  " + "\n  ".join(errors))
    return entries


def load_entry(path: Path) -> Entry:
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise KBError(f"{path}: not valid YAML: {exc}") from None
    return parse_entry(doc, path)


def parse_entry(doc: Any, path: Path) -> Entry:
    where = str(path)
    if not isinstance(doc, dict):
        raise KBError(f"{where}: the file must hold a mapping, got {type(doc).__name__}")
    known = {"name", "description", "fingerprint", "rules", "evidence", "remediation", "requires", "roles"}
    _no_unknown(doc, known, where)
    name = _required(doc, "name", str, where)
    if not NAME_RE.match(name) or name == UNMATCHED:
        raise KBError(f"{where}: name {name!r} must match {NAME_RE.pattern} and not be {UNMATCHED!r}")
    if name != path.stem:
        raise KBError(f"{where}: name {name!r} must equal the file name {path.stem!r}")
    description = _required(doc, "description", str, where).strip()
    pattern = _required(doc, "fingerprint", dict, where)
    try:
        fingerprint = pattern_vector(pattern, f"{where}: fingerprint")
    except (TypeError, ValueError) as exc:
        raise KBError(str(exc) if str(exc).startswith(where) else f"{where}: fingerprint: {exc}") from None
    rules = _required(doc, "rules", dict, where)
    _no_unknown(rules, {"all", "any", "unless", "support", "or"}, f"{where}: rules")
    all_rules = _conditions(rules.get("all", []), f"{where}: rules.all")
    any_rules = _conditions(rules.get("any", []), f"{where}: rules.any")
    unless_rules = _conditions(rules.get("unless", []), f"{where}: rules.unless")
    support_rules = _conditions(rules.get("support", []), f"{where}: rules.support")
    if not all_rules and not any_rules:
        raise KBError(f"{where}: rules: give at least one condition under `all` or `any`")
    alternatives = _alternatives(rules.get("or", []), f"{where}: rules.or")
    evidence = _required(doc, "evidence", list, where)
    if not evidence or not all(isinstance(e, str) and e for e in evidence):
        raise KBError(f"{where}: evidence must be a non-empty list of feature names")
    remediation = _remediation(_required(doc, "remediation", dict, where), f"{where}: remediation")
    requires = doc.get("requires", [])
    if not isinstance(requires, list) or not all(isinstance(r, str) and r for r in requires):
        raise KBError(f"{where}: requires: must be a list of feature names (or peer_z.<feature>)")
    alternative_rules = tuple(c for b in alternatives for c in b.all_rules + b.any_rules)
    missing = _missing_inputs(all_rules, any_rules, evidence, tuple(requires), where,
                              unless_rules + support_rules + alternative_rules)
    roles = doc.get("roles", list(ROLES))
    if not isinstance(roles, list) or not roles or not all(r in ROLES for r in roles):
        raise KBError(f"{where}: roles: must be a non-empty list of {list(ROLES)}, got {roles!r}")
    return Entry(name, description, fingerprint, all_rules, any_rules, tuple(evidence), remediation, path, missing,
                 tuple(roles), unless_rules, support_rules, alternatives)


def _listed_mappings(items: Any, where: str, a_list_of: str, an_item_is: str):
    """(where[i], item) for each mapping of the list ``items``; KBError naming the place otherwise."""
    if not isinstance(items, list):
        raise KBError(f"{where}: must be a list of {a_list_of}")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise KBError(f"{where}[{i}]: {an_item_is}")
        yield f"{where}[{i}]", item


def _alternatives(items: Any, where: str) -> tuple[RuleBlock, ...]:
    out = []
    for w, block in _listed_mappings(items, where, "rule blocks, each with `all` and/or `any`",
                                     "a rule block is a mapping with `all` and/or `any`"):
        _no_unknown(block, {"all", "any", "remediation"}, w)
        own = (_remediation(_required(block, "remediation", dict, w), f"{w}.remediation")
               if "remediation" in block else None)
        b = RuleBlock(_conditions(block.get("all", []), f"{w}.all"), _conditions(block.get("any", []), f"{w}.any"),
                      own)
        if not b.all_rules and not b.any_rules:
            raise KBError(f"{w}: give at least one condition under `all` or `any`")
        out.append(b)
    return tuple(out)


def _need(c: Condition) -> str:
    return c.name if c.source == "feature" else f"peer_z.{c.name}"


def _computed(need: str) -> bool:
    """Does the running pipeline provide this input? (a feature value, or a peer z of a rank feature)"""
    return need[len("peer_z."):] in PEER_Z_FEATURES if need.startswith("peer_z.") else need in ALL_FEATURES


def _missing_inputs(all_rules, any_rules, evidence, requires: tuple[str, ...], where: str,
                    other_rules=()) -> tuple[str, ...]:
    """The inputs an entry's rules wait for; KBError for a name no builder emits that `requires` does not list."""
    waited = {r[len("peer_z."):] if r.startswith("peer_z.") else r for r in requires}
    named = ([(f"rules: {_need(c)}", c.name) for c in all_rules + any_rules + tuple(other_rules)]
             + [("evidence", e) for e in evidence])
    for place, feature in named:
        if feature not in ALL_FEATURES and feature not in waited:
            raise KBError(f"{where}: {place}: feature {feature!r} is emitted by no feature builder "
                          f"(streams/feature_catalogue.py); fix the name, or list it under `requires:`")
    missing = [_need(c) for c in all_rules if not _computed(_need(c))]
    if any_rules and not any(_computed(_need(c)) for c in any_rules):
        missing += [_need(c) for c in any_rules]
    unlisted = [m for m in missing if m not in requires]
    if unlisted:
        raise KBError(f"{where}: rules can never hold: the pipeline computes no {unlisted} "
                      f"(peer z exists for rank features only); list them under `requires:`")
    stale = [r for r in requires if _computed(r)]
    if stale:
        raise KBError(f"{where}: requires: {stale} are computed now; remove them from `requires:`")
    return tuple(dict.fromkeys(missing))


def _conditions(items: Any, where: str) -> tuple[Condition, ...]:
    out = []
    for w, item in _listed_mappings(items, where, "conditions",
                                    "a condition is a mapping like {feature: X, op: '>=', value: 1}"):
        _no_unknown(item, {"feature", "peer_z", "op", "value", "abs", "if_present"}, w)
        sources = [s for s in ("feature", "peer_z") if s in item]
        if len(sources) != 1:
            raise KBError(f"{w}: give exactly one of `feature` or `peer_z`")
        name = item[sources[0]]
        if not isinstance(name, str) or not name:
            raise KBError(f"{w}.{sources[0]}: must be a feature name")
        op = item.get("op")
        if op not in OPS:
            raise KBError(f"{w}.op: {op!r} is not one of {list(OPS)}")
        value = item.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise KBError(f"{w}.value: must be a finite number, got {value!r}")
        use_abs = item.get("abs", False)
        if_present = item.get("if_present", False)
        for key, flag in (("abs", use_abs), ("if_present", if_present)):
            if not isinstance(flag, bool):
                raise KBError(f"{w}.{key}: must be true or false")
        out.append(Condition(sources[0], name, op, float(value), use_abs, if_present))
    return tuple(out)


def _remediation(doc: dict, where: str) -> Remediation:
    _no_unknown(doc, {"command", "write", "check", "risk", "auto", "requires"}, where)
    kinds = [k for k in ("command", "write") if k in doc]
    if len(kinds) != 1:
        raise KBError(f"{where}: give exactly one of `command` or `write`")
    argv: tuple[str, ...] = ()
    path = value = ""
    if kinds[0] == "command":
        argv = _argv(doc["command"], f"{where}.command")
    else:
        w = doc["write"]
        if not isinstance(w, dict) or set(w) != {"path", "value"}:
            raise KBError(f"{where}.write: must be a mapping with exactly `path` and `value`")
        path, value = str(w["path"]), str(w["value"])
        if not path.startswith(("/sys/", "/proc/")):
            raise KBError(f"{where}.write.path: {path!r} must lie under /sys/ or /proc/")
        for text, w2 in ((path, "path"), (value, "value")):
            _placeholders(text, f"{where}.write.{w2}")
    check = _argv(doc["check"], f"{where}.check") if "check" in doc else ()
    risk = doc.get("risk")
    if risk not in RISKS:
        raise KBError(f"{where}.risk: {risk!r} is not one of {list(RISKS)}")
    auto = doc.get("auto")
    if not isinstance(auto, bool):
        raise KBError(f"{where}.auto: must be true or false (say it explicitly)")
    requires = doc.get("requires", [])
    if not isinstance(requires, list) or not all(isinstance(r, str) and r for r in requires):
        raise KBError(f"{where}.requires: must be a list of tool names")
    return Remediation(kinds[0], argv, path, value, check, risk, auto, tuple(requires))


def _argv(command: Any, where: str) -> tuple[str, ...]:
    if isinstance(command, list) and all(isinstance(t, str) for t in command):
        tokens = list(command)
    elif isinstance(command, str):
        try:
            tokens = shlex.split(command)
        except ValueError as exc:
            raise KBError(f"{where}: cannot split {command!r}: {exc}") from None
    else:
        raise KBError(f"{where}: must be a string or a list of strings")
    if not tokens:
        raise KBError(f"{where}: empty command")
    if any(t in ("|", "||", "&&", ";", ">", ">>", "<") or t.startswith(("$(", "`")) for t in tokens):
        raise KBError(f"{where}: shell syntax in {command!r}; commands run without a shell "
                      "(use `write:` to set a /sys or /proc value)")
    for t in tokens:
        _placeholders(t, where)
    return tuple(tokens)


def _placeholders(text: str, where: str) -> None:
    for name in PLACEHOLDER_RE.findall(text):
        if not PARAM_RE.match(name):
            raise KBError(f"{where}: placeholder {{{name}}} must be a lower-case identifier")
    stray = PLACEHOLDER_RE.sub("", text)
    if "{" in stray or "}" in stray:
        raise KBError(f"{where}: unbalanced brace in {text!r}")


def _required(doc: dict, key: str, kind: type, where: str):
    if key not in doc:
        raise KBError(f"{where}: missing field `{key}`")
    value = doc[key]
    if not isinstance(value, kind):
        raise KBError(f"{where}: `{key}` must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _no_unknown(doc: dict, known: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in set(doc) - known)
    if unknown:
        raise KBError(f"{where}: unknown fields {unknown}; allowed: {sorted(known)}")

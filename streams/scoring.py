"""Scores every released job step with the job's model; flags, explains and publishes anomalies.

Runs on the flush thread, after the step's feature rows are stored:
- the model scores each rank's own features; a flagged window's vector adds
  its host's node features of the same window (CPU, memory, IRQ, disk,
  network) as evidence for diagnosis;
- each node window is scored by the node's own model (model/node.py); a
  flagged one explains the ranks of that host flagged alike in that window
  (role `node`), never a rank nothing else flagged (see _attribute_node);
- each job step's collective rate, and its OFU (the mean of its ranks' own
  GPUs', rank_context.job_gpu_means, added to every rank's evidence), are
  judged against the job's own history (model/job_rate.py); a job-wide
  slowdown or OFU fall that no minority of culprits explains flags every
  rank of the step, role `job`;
- one JobModel per (tenant, job) and per node (tenant `_node`, job = host), restored from `model_state` the first time
  this worker sees the job and checkpointed every `checkpoint_s`, with the job's rate/OFU history and
  memory-drift series as parts of the same checkpoint (``parts``);
- every flagged rank-window gets a role (model/roles.py): `culprit`, or
  `waiting` for a peer that only waits on a culprit in collectives;
- every (rank, window) goes to `scores` and `<prefix>.scores`, with its role;
  flagged ones to `anomalies`; all but waiting ones to `<prefix>.anomalies`
  (JSON, for alerting) and through the knowledge base to `diagnoses` and
  `<prefix>.diagnoses`.
"""
from __future__ import annotations

import base64
import json
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fleetscope import wire
from fleetscope.schema import NODE_TENANT
from fleetscope.wire import Batch, StrColumn
from fleetscope.streams.model import JobModel, ModelConfig
from fleetscope.streams.model.ensemble import DETECTORS, Rule
from fleetscope.streams.model.config import WindowScore
from fleetscope.streams.model.confirmation import UNCONFIRMED, AlertConfirmation, parse_confirm
from fleetscope.streams.model.loud import KIND_FEATURE, LoudFailures
from fleetscope.streams.model.drift import MemoryDrift
from fleetscope.streams.model.job_rate import JobRates
from fleetscope.streams.model.receive_wakeups import FEATURE as LINK_FEATURE, ReceiveWakeups, slow_receivers
from fleetscope.streams.model.outside_load import OutsideLoad
from fleetscope.streams.model.node import NODE_ROW, NodeFlag, NodeFlags, history_z, node_model_config, node_model_input
from fleetscope.streams.model.roles import (CULPRIT, JOB, MIN_SLOWDOWN, NODE, WAITING, assign_roles,
                                            differs_from_peers, explains_slowdown, finite, last_arrivers)
from fleetscope.streams.model.locality import MIN_COMPARED, OUTSIDE_FEATURE, NeighbourPlacement, local_rows
from fleetscope.streams.stack_signature import model_input
from fleetscope.streams.rank_context import RankContext, job_gpu_means, joined_peer_z
from fleetscope.streams.derived_codec import ANOMALY_SCHEMA, DIAGNOSIS_SCHEMA, schema_header
from fleetscope.streams.sinks import token

log = logging.getLogger(__name__)
# The detectors that judge a rank against its own past only (every other detector compares it with its peers,
# its node or its job, or saw a loud failure)
OWN_MODEL_DETECTORS = frozenset(d for d in DETECTORS if d != "peer")
# A step every rank and the node's own model flagged, and nothing else (Scorer._unflag_job_alike)
NODE_ALIKE_DETECTORS = OWN_MODEL_DETECTORS | {"peer", "node"}


class NamedCulprits(NamedTuple):
    by_minority: bool          # a minority of culprits the peer comparison flagged already explains the change
    rows: list[int] | None     # else the rows to name culprits (the rest wait); None: no rank is named
    how: str | None            # "arrival" or "locality": what named them
    not_explained: bool        # culprits or last arrivers were there, but did not account for the change


def name_culprits(results, roles, loud_rows, evidence, ratio) -> NamedCulprits:
    """Who a change of the whole step (the job's rate or OFU, the host's outside load) is one rank's doing of.

    A minority of culprits explains it only when their peers' comparison flagged them (roles.differs_from_peers).
    Otherwise the order of arrival at the step's collectives names the ranks the others wait for, long enough to
    account for the slower iterations (roles.last_arrivers, roles.explains_slowdown), or, when it names none,
    the ranks whose CPUs carry clearly more interrupt work (model/locality.py)."""
    culprit_rows = [i for i, r in enumerate(roles) if r == CULPRIT and i not in loud_rows]
    not_explained = False
    if culprit_rows and 2 * len(culprit_rows) < len(results):
        if any(differs_from_peers(results[i].detectors) for i in culprit_rows):
            return NamedCulprits(True, None, None, False)
        not_explained = True
    late = last_arrivers(evidence)
    if late is not None and not explains_slowdown(evidence, late, ratio):
        late, not_explained = None, True
    if late is not None:
        return NamedCulprits(False, late, "arrival", not_explained)
    local = local_rows(range(len(results)), evidence)   # interrupt work may still sit on some ranks' CPUs
    return NamedCulprits(False, local or None, "locality" if local else None, not_explained)


class VanishedWindow(NamedTuple):
    """The window a rank should have sent: scored and flagged on its behalf (model/loud.py)."""
    key: tuple
    start_ns: int


MODEL_COUNTERS = ("features_admitted", "admission_windows_skipped", "phase_windows_learned")   # the job models'
# counters the worker sums


@dataclass
class ScoringStats:
    steps: int = 0
    scored: int = 0
    anomalies: int = 0
    diagnoses: int = 0
    unmatched: int = 0
    models: int = 0
    restored_models: int = 0
    checkpoints: int = 0
    node_join_misses: int = 0  # anomalies diagnosed without their host's node features
    features_admitted: int = 0  # late features that joined a job's score (FeatureAdmission)
    admission_windows_skipped: int = 0  # windows a late feature's round did not count: a rank was flagged
    phase_windows_learned: int = 0  # windows of a short job-wide burst learned once it ended (JobModel, a phase)
    waiting: int = 0  # flagged rank-windows labelled waiting: stored, not alerted
    promoted: int = 0  # unflagged ranks every flagged peer waited for, flagged as the culprit
    node_windows: int = 0  # node windows scored by their node's model
    node_anomalies: int = 0  # of them flagged
    node_attributed: int = 0  # rank-windows flagged with role node
    node_localised: int = 0  # of those, culprits named by their own CPUs' interrupt work (model/locality.py)
    job_alike_unflagged: int = 0  # rank-windows flagged alike across a whole step, left to job_rate
    node_not_attributed: int = 0  # rank-windows of a flagged node window left as they were (see _attribute_node)
    job_rate_flags: int = 0  # job steps whose collective rate left the job's own history
    job_ofu_flags: int = 0  # job steps whose OFU fell against the job's own history
    job_named_by_arrival: int = 0  # of those, steps whose culprits the order of arrival named (roles.last_arrivers)
    job_named_by_link: int = 0  # of those, steps whose culprits woke clearly more per collective (receive_wakeups.py)
    job_named_by_locality: int = 0  # of those, steps whose culprits their CPUs' interrupt work named (model/locality.py)
    job_not_explained: int = 0  # job flags whose culprits did not differ from their peers, or whose last arrivers were not waited for enough
    outside_flags: int = 0  # rank-windows flagged for load from outside the job on their host (model/outside_load.py)
    outside_placed: int = 0  # of those job steps, ones whose culprits the outside load's CPUs named (model/locality.py)
    drifting: int = 0  # rank-windows whose memory held drifts up (model/drift.py): flagged, not learned
    unconfirmed: int = 0  # flagged rank-windows not (yet) flagged in K of their rank's last N (model/confirmation.py)


class Scorer:
    def __init__(self, cfg, store, producer=None, model_config: ModelConfig | None = None, diagnoser=None):
        self.cfg = cfg
        self.store = store
        self.producer = producer
        if model_config is None:
            # only the detectors the rule consults: HalfSpaceTrees alone made scoring 8x slower
            needed = Rule.parse(cfg.detect_rule).names
            model_config = ModelConfig(warmup_windows=cfg.warmup_windows, rule=cfg.detect_rule, window_s=cfg.window_s,
                                       detectors=tuple(d for d in DETECTORS if d == "gmm" or d in needed))
        self.model_config = model_config
        self.node_model_config = node_model_config(model_config)
        if diagnoser is None:
            from fleetscope.streams.diagnosis.pipeline import Diagnoser
            diagnoser = Diagnoser()
        self.diagnoser = diagnoser
        self.models: dict[tuple[str, str], JobModel] = {}
        self.saved_at: dict[tuple[str, str], float] = {}
        self.context = RankContext()
        self.loud = LoudFailures()
        self.node_flags = NodeFlags()
        self.confirmation = AlertConfirmation(*parse_confirm(cfg.alert_confirm), window_ns=int(cfg.window_s * 1e9))
        self.drift = MemoryDrift(warmup=self.model_config.warmup_windows)   # start-up growth is not a leak
        self.job_rates = JobRates(warmup=max(self.model_config.warmup_windows, 5),
                                  regime_windows=self.model_config.slowdown_regime_windows)
        self.outside = OutsideLoad(warmup=max(self.model_config.warmup_windows, 5),
                                   regime_windows=self.model_config.slowdown_regime_windows)
        self.placement = NeighbourPlacement()
        self.receivers = ReceiveWakeups()
        self.stats = ScoringStats()

    # ---- models ---------------------------------------------------------------
    def model(self, tenant: str, job: str) -> JobModel:
        key = (tenant, job)
        m = self.models.get(key)
        if m is None:
            m = self._restore(tenant, job) or JobModel(self.config_for(tenant))
            self.models[key] = m
            self.saved_at[key] = time.monotonic()
            self.stats.models += 1
        return m

    def parts(self, tenant: str, job: str) -> dict:
        """The job's detectors outside its model, saved and restored with it (model/checkpoint.py)."""
        if tenant == NODE_TENANT:
            return {}
        return {"job_rate": self.job_rates.part((tenant, job)), "drift": self.drift.part((tenant, job)),
                "confirmation": self.confirmation.part((tenant, job)), "outside_load": self.outside.part((tenant, job)),
                "placement": self.placement.part((tenant, job)),
                "receive_wakeups": self.receivers.part((tenant, job))}

    def config_for(self, tenant: str) -> ModelConfig:
        """A node's model has one row per window: a longer warm-up (model/node.py)."""
        return self.node_model_config if tenant == NODE_TENANT else self.model_config

    def _restore(self, tenant: str, job: str) -> JobModel | None:
        res = self.store.query("SELECT state FROM model_state FINAL WHERE tenant = {t:String} AND job = {j:String} "
                               "ORDER BY saved_at DESC LIMIT 1", {"t": tenant, "j": job})
        if not res.rows:
            return None
        try:
            m = JobModel.from_bytes(base64.b64decode(res.rows[0][0]), self.parts(tenant, job))
        except Exception:  # an unreadable checkpoint (older format): start afresh, visibly
            log.exception("model checkpoint of %s/%s unreadable; relearning", tenant, job)
            return None
        self.stats.restored_models += 1
        log.info("restored the model of %s/%s from its checkpoint", tenant, job)
        return m

    def checkpoint(self, force: bool = False) -> None:
        now = time.monotonic()
        due = [k for k in self.models if force or now - self.saved_at[k] >= self.cfg.model_checkpoint_s]
        if not due:
            return
        wall = time.time_ns()
        rows = {"tenant": [k[0] for k in due], "job": [k[1] for k in due],
                "saved_at": np.full(len(due), wall, dtype=np.int64),
                "last_window": np.array([max(self.models[k].last_window_ns, 0) // 10**6 * 10**6 for k in due],
                                        dtype=np.int64),
                "state": [base64.b64encode(self.models[k].to_bytes(self.parts(*k))).decode() for k in due]}
        self.store.insert("model_state", rows, dedupe_token=token("model_state", [f"{k}@{wall}" for k in due]))
        for k in due:
            self.saved_at[k] = now
        self.stats.checkpoints += len(due)

    # ---- scoring --------------------------------------------------------------
    def write(self, windows, vectors) -> None:
        steps: dict[tuple[str, str, int], list[tuple[object, dict]]] = {}
        nodes = []
        for w, v in zip(windows, vectors):
            if w.key[0] == NODE_TENANT:
                self.context.remember(w, v)
                nodes.append((w, v))
            else:
                steps.setdefault((w.key[0], w.key[1], w.start_ns), []).append((w, v))
        scored, flagged = [], []
        for w, v in sorted(nodes, key=lambda wv: wv[0].start_ns):   # before the ranks they are attributed to
            scored.append(self._score_node(w, v))
        if not steps:
            self._finish(scored, flagged)
            return
        for (tenant, job, start), members in sorted(steps.items(), key=lambda kv: kv[0][2]):
            # The model sees each rank's own features only. Host features are the same for every rank on a
            # host, so in the model they flagged whole jobs whenever the host got busy (replayed on the
            # evaluation runs: healthy runs 53% of windows flagged with them, 0.7% without); they stay
            # in the anomaly's vector as evidence for diagnosis.
            rows = [(w.key[3], model_input(v)) for w, v in members]   # categorical ids stay out of the model
            model = self.model(tenant, job)
            before = [model.stats[name] for name in MODEL_COUNTERS]
            # a rank whose memory drifts is held: neither the model nor its thresholds learn the leak
            drifts = self.drift.step((tenant, job), start, [(w.key[2], w.key[3]) for w, _ in members],
                                     [v for _, v in members])
            held = [False] * len(members)
            for d in drifts:
                held[d.index] = True
            results = model.process_window(start, rows, hold=held if drifts else None)
            for name, was in zip(MODEL_COUNTERS, before):
                setattr(self.stats, name, getattr(self.stats, name) + model.stats[name] - was)
            self.stats.steps += 1
            self._judge(tenant, job, start, members, results, scored, flagged, drifts)
        self._finish(scored, flagged)

    def _finish(self, scored, flagged) -> None:
        if not scored:
            return
        self.stats.scored += len(scored)
        self.stats.anomalies += len(flagged)
        now = time.time_ns()
        self._store_scores(scored, now)
        if flagged:
            self._store_anomalies(flagged, now)
        self.checkpoint()

    def _score_node(self, w, v) -> tuple:
        """Score one node window with its node's model; remember it when flagged (model/node.py)."""
        host = w.key[1]
        model = self.model(NODE_TENANT, host)
        row = node_model_input(v)
        (s,) = model.process_window(w.start_ns, [(NODE_ROW, row)])
        self.stats.node_windows += 1
        if s.is_anomaly:
            self.stats.node_anomalies += 1
            self.node_flags.add(w.key[2], w.start_ns,
                                NodeFlag(s.score, s.threshold, dict(s.contributions), history_z(model, row)))
        return (w, s, NODE if s.is_anomaly else "")

    def _judge(self, tenant, job, start, members, results, scored, flagged, drifts=()) -> None:
        """Roles (model/roles.py) and loud failures (model/loud.py) of one scored job step."""
        evidence, unjoined = [], set()
        for i, (w, v) in enumerate(members):
            node = self.context.joined(w)
            if node is None:
                unjoined.add(i)
            evidence.append({**(node or {}), **v})
        joined_z = joined_peer_z(evidence)
        for v, frac in zip(evidence, self.context.outside_on_rank_cpus([w for w, _ in members], evidence)):
            if frac is not None:   # the share of the rank's CPUs outside work took (streams/cpu_features.py)
                v[OUTSIDE_FEATURE] = frac
        job_gpu = job_gpu_means(evidence)   # the job's OFU per window: judged below against its own history
        for v in evidence:
            v.update(job_gpu)
        step = assign_roles([w.key[3] for w, _ in members], [v for _, v in members],
                            [s.is_anomaly for s in results])
        roles = list(step.roles)
        for i in step.promoted:
            results[i].is_anomaly = True
            results[i].detectors.append("wait")
        self.stats.promoted += len(step.promoted)
        ghosts, explained, loud_rows = [], {}, set()
        for d in drifts:   # a slow leak: the drifting rank is the culprit, its growth the explanation
            s = results[d.index]
            if not s.is_anomaly:
                explained[d.index] = dict(d.features)
            s.is_anomaly = True
            s.detectors.append("drift")
            evidence[d.index].update(d.features)
            roles[d.index] = CULPRIT
            loud_rows.add(d.index)
            self.stats.drifting += 1
        for f in self.loud.step((tenant, job), start, [(w.key[2], w.key[3]) for w, _ in members], evidence):
            if f.index is None:   # a vanished rank: a row of its own, in the window it went silent
                ghost = VanishedWindow((tenant, job, f.host, f.rank), f.start_ns if f.start_ns is not None else start)
                ghosts.append((ghost, WindowScore(f.rank, float("nan"), None, True, [f.kind], warm=True),
                               f.features))
                continue
            s = results[f.index]
            if not s.is_anomaly:   # the loud signal alone made it anomalous: it is the explanation
                explained[f.index] = {k: 1.0 for k in f.features or (KIND_FEATURE[f.kind],)}
            s.is_anomaly = True
            if f.kind not in s.detectors:
                s.detectors.append(f.kind)
            evidence[f.index].update(f.features)
            roles[f.index] = f.role or (JOB if f.kind == "hung" else CULPRIT)
            loud_rows.add(f.index)
        rate = self.job_rates.step((tenant, job), start, evidence)
        if rate is not None:
            for v in evidence:
                v.update(rate.features)
        wakeups = self.receivers.step((tenant, job), [w.key[3] for w, _ in members], evidence)
        if rate is not None and rate.flagged and self._flag_job(results, roles, loud_rows, explained, "job_rate",
                                                                "job_iteration_time_ratio", rate.features, evidence,
                                                                wakeups):
            self.stats.job_rate_flags += 1
        if rate is not None and rate.ofu_flagged and self._flag_job(results, roles, loud_rows, explained, "job_ofu",
                                                                    "job_ofu_ratio", rate.features, evidence):
            self.stats.job_ofu_flags += 1
        ratio = rate.features.get("job_iteration_time_ratio") if rate is not None else None
        outside = self.outside.step((tenant, job), start, [w.key[2] for w, _ in members], evidence, ratio)
        for i, (w, _) in enumerate(members):
            if w.key[2] in outside:
                evidence[i].update(outside[w.key[2]].features)
        self._flag_outside((tenant, job), outside, members, results, roles, loud_rows, explained, evidence, ratio)
        self._attribute_node(start, members, results, roles, loud_rows, explained, joined_z, evidence)
        self._unflag_job_alike(results, roles, loud_rows, ratio)
        self._confirm(members, start, results, roles, loud_rows)
        culprits = sorted({int(members[i][0].key[3]) for i, r in enumerate(roles) if r == CULPRIT}
                          | {g.key[3] for g, _, _ in ghosts})
        for i, ((w, _), s) in enumerate(zip(members, results)):
            scored.append((w, s, roles[i] if s.is_anomaly else ""))
            if s.is_anomaly:
                self.stats.node_join_misses += i in unjoined
                flagged.append((w, s, evidence[i], roles[i], culprits, joined_z[i], explained.get(i, {})))
        for ghost, s, features in ghosts:
            scored.append((ghost, s, CULPRIT))
            flagged.append((ghost, s, features, CULPRIT, culprits, {}, features))

    def _confirm(self, members, start, results, roles, loud_rows) -> None:
        """A rank-window stays flagged once its rank was flagged in K of its last N windows; loud rows alert
        at once (model/confirmation.py). The others are stored unflagged, detector ``unconfirmed``."""
        for i, ((w, _), s) in enumerate(zip(members, results)):
            # a loud flag alerted on its own: it confirms none of the model's later ones (after a hang, the first
            # windows of the resumed job confirmed their lone flags on the hang's: 3 to 5 false culprit flags)
            if self.confirmation.confirm(w.key, start, s.is_anomaly and i not in loud_rows) or not s.is_anomaly \
                    or i in loud_rows:
                continue
            s.is_anomaly = False
            s.detectors.append(UNCONFIRMED)
            roles[i] = ""
            self.stats.unconfirmed += 1

    def _unflag_job_alike(self, results, roles, loud_rows, ratio) -> None:
        """Every rank flagged alike by its own model, with no rank waiting for another and neither the job's
        rate nor the node explaining it, is a change the whole job shares: the job's own history judges
        those (job_rate.py), not each rank's model. On a busy host the whole job hiccups together (the dev
        scenarios' healthy run: 10 such steps flagged all three ranks at once, a third of its false positives).

        So is such a step whose ranks the order of arrival parts into a culprit and its waiting peers, when
        only their own models flagged them (no peer comparison, and no node, outside-load, job or loud detector
        gave them their roles) and the job's iterations are no slower than its history
        (job_iteration_time_ratio below roles.MIN_SLOWDOWN): nobody was held up, so the rank that happened to
        arrive last caused nothing. Dev two_faults_overlap: after both faults ended, the models that had
        learned the faulty regime flagged all three ranks alike in 18 steps at a ratio of 0.90-1.08, and
        the healthy ring's own skew named a culprit in each, 17 false positives.

        And so is such a step that the node's model flagged too (role node on its ranks), when only the ranks'
        own models, their peer comparison and the node's model flagged it and the job is no slower: a change of
        the node that every rank shows but that held up no one, such as a checkpoint's burst of disk writes (the
        dev scenario healthy_eval_checkpoint: every rank and the node flagged in the window of each checkpoint,
        all through the run, the job's rate unchanged; as raw flags they confirmed the lone flags of the
        windows after them). On the dev runs kept from stops 44 to 46, no such step fell inside a fault.
        """
        if len(results) < 2 or loud_rows or not all(s.is_anomaly for s in results):
            return
        def only(kinds, detectors) -> bool:
            return all(role in kinds for role in roles) and all(set(s.detectors) <= detectors for s in results)

        no_slower = finite(ratio) and ratio < MIN_SLOWDOWN
        every_rank_its_own = all(role == CULPRIT for role in roles)
        arrival_skew_only = no_slower and only((CULPRIT, WAITING), OWN_MODEL_DETECTORS)
        node_change_only = no_slower and only((CULPRIT, NODE), NODE_ALIKE_DETECTORS)
        if not (every_rank_its_own or arrival_skew_only or node_change_only):
            return
        for i, s in enumerate(results):
            s.is_anomaly = False
            roles[i] = ""
        self.stats.job_alike_unflagged += len(results)

    def _attribute_node(self, start, members, results, roles, loud_rows, explained, joined_z, evidence) -> None:
        """A flagged node window explains its host's ranks when every one of them is flagged and none waits.

        It flags no rank by itself: the job is most of its node's load, so one rank stalling moves its node's
        CPU and memory too (the dev scenarios' dataloader stall flagged the node in 25 of its 29 fault windows,
        and, attributed to every rank, made 99 of its 118 flagged rank-windows, most of its 87 false positives),
        and a node change that no rank feels has no impact on the job. What the node does, it does to all of its ranks: when each rank of the host is
        flagged (by the model, as a culprit, or by the job's rate) and none is waiting for another, they get
        role node, with the node's contributions and its z against its own past, so the diagnosis reads the
        node's change. One culprit among healthy peers on the same host is its own cause and keeps its role.

        Not everything a node does, it does to all of its ranks alike: interrupt work lands on particular
        CPUs. When the CPUs of a minority of the host's ranks stand out from their peers' (model/locality.py),
        those ranks are the node's culprits and the rest wait for them, as in a straggler step.
        """
        by_host: dict[str, list[int]] = {}
        for i, (w, _) in enumerate(members):
            by_host.setdefault(w.key[2], []).append(i)
        for host, rows in by_host.items():
            node = self.node_flags.get(host, start)
            if node is None:
                continue
            # not while the job warms up: its own start changes the node (3 gloo ranks starting flagged
            # their host in the CI run), and the job's model flags nothing then either
            rows = [i for i in rows if i not in loud_rows and results[i].warm]
            if not rows or not all(results[i].is_anomaly and roles[i] != WAITING for i in rows):
                self.stats.node_not_attributed += len(rows)
                continue
            local = local_rows(rows, evidence)
            self.stats.node_localised += len(local)
            for i in rows:
                results[i].detectors.append("node")
                roles[i] = NODE if not local else CULPRIT if i in local else WAITING
                explained[i] = {**node.contributions, **explained.get(i, {})}
                joined_z[i] = {**joined_z[i], **node.history_z}   # the node against its own past
                self.stats.node_attributed += 1

    def _flag_outside(self, job, outside, members, results, roles, loud_rows, explained, evidence, ratio) -> None:
        """A host whose load from outside the job rose while the job slowed (model/outside_load.py) flags its
        ranks, role node, the outside load their explanation. Unless a minority of culprits differs from its
        peers: that more specific story stands (its own diagnosis says why). Where the load sits decides next:
        beside a minority of the host's ranks (its CPU work on theirs: locality.NeighbourPlacement), those are
        the culprits and the rest wait; on all of them alike (every flagged host's ranks compared), role node,
        whoever arrived last. Only where the CPUs cannot tell does a peer waiting for a culprit stand, or the
        order of arrival name the ranks the others wait for, or interrupt work on their CPUs, as for the job's
        rate (name_culprits)."""
        for host, verdict in outside.items():
            if not verdict.flagged:
                self.placement.forget((*job, host))
        hosts = {h for h, v in outside.items() if v.flagged}
        if not hosts:
            return
        named = name_culprits(results, roles, loud_rows, evidence, ratio)
        if named.by_minority:
            return
        beside, compared = self._beside_neighbour(job, hosts, members, results, loud_rows, evidence)
        if not beside and not compared and any(r == WAITING for r in roles):
            return   # nothing says where the load sits: the peers waiting for a culprit stand
        # the CPUs say the load is on all of the host's ranks alike: whoever arrived last was hit by chance
        # (dev scenario outside_load_node, free busy loops: the order of arrival named one rank the culprit,
        # and its peers waiting, in 10 to 14 of the 30 loaded windows)
        late = beside or (None if compared else named.rows)
        for i, (w, _) in enumerate(members):
            if i in loud_rows or not results[i].warm or (late is None and w.key[2] not in hosts):
                continue
            verdict = outside.get(w.key[2])
            s = results[i]
            s.is_anomaly = True
            s.detectors.append("outside_load")
            roles[i] = NODE if late is None else CULPRIT if i in late else WAITING
            if verdict is not None and verdict.flagged:
                explained[i] = {**explained.get(i, {}), "outside_cpu_rise_cores": verdict.features["outside_cpu_rise_cores"]}
                if roles[i] == CULPRIT and OUTSIDE_FEATURE in evidence[i]:
                    explained[i][OUTSIDE_FEATURE] = evidence[i][OUTSIDE_FEATURE]
            self.stats.outside_flags += 1

    def _beside_neighbour(self, job, hosts, members, results, loud_rows, evidence) -> tuple[list[int], bool]:
        """The rows of the flagged hosts whose CPUs the outside load sits on (locality.NeighbourPlacement), and
        whether every flagged host had enough ranks with a known share (OUTSIDE_FEATURE) to tell."""
        beside, compared = [], True
        for host in sorted(hosts):
            rows = [i for i, (w, _) in enumerate(members) if w.key[2] == host and i not in loud_rows and results[i].warm]
            beside += self.placement.place((*job, host), rows, [w.key[3] for w, _ in members], evidence)
            compared = compared and sum(OUTSIDE_FEATURE in evidence[i] for i in rows) >= MIN_COMPARED
        self.stats.outside_placed += bool(beside)
        return sorted(beside), compared

    def _flag_job(self, results, roles, loud_rows, explained, detector: str, feature: str, features: dict,
                  evidence, wakeups=()) -> bool:
        """Flag every rank of the step unless a minority of culprits explains the change: their peers'
        comparison flagged them (roles.differs_from_peers). Role job, unless the order of arrival at the
        step's collectives names the ranks the others wait for, long enough to account for the slower
        iterations (roles.last_arrivers, roles.explains_slowdown), or, when it names none, the ranks whose
        CPUs carry clearly more interrupt work (model/locality.py), or, for the job's rate, the ranks that wake
        clearly more per collective than their peers (``wakeups``: model/receive_wakeups.py, a rank behind a slow
        link): those are culprits and the rest waiting.
        The whole job changing alike, or most ranks looking odd at once, is the job's own: a culprit only its
        own history flagged, like its peers, merely arrived last (dev scenario job_wide_slowdown: a quota on
        every rank). Loud rows and node-flagged ranks keep theirs."""
        ratio = features.get("job_iteration_time_ratio")
        named = name_culprits(results, roles, loud_rows, evidence, ratio)
        if named.by_minority:
            return False
        self.stats.job_not_explained += named.not_explained
        self.stats.job_named_by_arrival += named.how == "arrival"
        self.stats.job_named_by_locality += named.how == "locality"
        late = named.rows
        if late is None and detector == "job_rate":
            late = slow_receivers([None if i in loud_rows or roles[i] == NODE else x
                                   for i, x in enumerate(wakeups)]) if wakeups else None
            self.stats.job_named_by_link += late is not None
            for i in late or ():   # only what named them: a rank the order of arrival named keeps its own story
                evidence[i][LINK_FEATURE] = wakeups[i]
                explained[i] = {**explained.get(i, {}), LINK_FEATURE: wakeups[i]}
        for i, s in enumerate(results):
            if i in loud_rows or roles[i] == NODE:
                continue
            s.is_anomaly = True
            if detector not in s.detectors:
                s.detectors.append(detector)
            roles[i] = JOB if late is None else CULPRIT if i in late else WAITING
            explained[i] = {**explained.get(i, {}), feature: features[feature]}
        return True

    def _store_scores(self, scored, now: int) -> None:
        n = len(scored)
        rows = {"tenant": [w.key[0] for w, _, _ in scored], "job": [w.key[1] for w, _, _ in scored],
                "host": [w.key[2] for w, _, _ in scored],
                "rank": np.array([w.key[3] for w, _, _ in scored], dtype=np.int32),
                "window_start": np.array([w.start_ns for w, _, _ in scored], dtype=np.int64),
                "score": np.array([s.score for _, s, _ in scored], dtype=np.float64),
                "threshold": np.array([np.nan if s.threshold is None else s.threshold for _, s, _ in scored]),
                "is_anomaly": np.array([s.is_anomaly for _, s, _ in scored], dtype=np.uint8),
                "role": [role for _, _, role in scored],
                "detectors": [list(s.detectors) for _, s, _ in scored],
                "warm": np.array([s.warm for _, s, _ in scored], dtype=np.uint8),
                "emitted_at": np.full(n, now, dtype=np.int64)}
        ids = [f"{w.key}@{w.start_ns}" for w, _, _ in scored]
        self.store.insert("scores", rows, dedupe_token=token("scores", ids))
        if self.producer is not None:
            by_job: dict[tuple[str, str], list[int]] = {}
            for i, (w, _, _) in enumerate(scored):
                by_job.setdefault(w.key[:2], []).append(i)
            for (tenant, job), idx in by_job.items():
                batch = scores_batch(self.cfg.host, [scored[i] for i in idx])
                self.producer.produce(self.cfg.topic("scores"), key=f"{tenant}/{job}".encode(),
                                      value=wire.encode(batch), headers=batch.kafka_headers())

    def _store_anomalies(self, flagged, now: int) -> None:
        anomalies = [anomaly_record(w, s, vector, role, culprits, joined_z, loud)
                     for w, s, vector, role, culprits, joined_z, loud in flagged]
        rows = {"tenant": [a["tenant"] for a in anomalies], "job": [a["job"] for a in anomalies],
                "host": [a["host"] for a in anomalies], "rank": np.array([a["rank"] for a in anomalies], dtype=np.int32),
                "window_start": np.array([a["window_start_ns"] for a in anomalies], dtype=np.int64),
                "score": np.array([a["score"] for a in anomalies]),
                "threshold": np.array([a["threshold"] for a in anomalies]),
                "detectors": [a["detectors"] for a in anomalies], "role": [a["role"] for a in anomalies],
                "contributions": [a["contributions"] for a in anomalies],
                "peer_z": [a["peer_z"] for a in anomalies], "feature": [a["features"] for a in anomalies],
                "emitted_at": np.full(len(anomalies), now, dtype=np.int64)}
        ids = [f"{a['tenant']}/{a['job']}/{a['host']}/{a['rank']}@{a['window_start_ns']}" for a in anomalies]
        self.store.insert("anomalies", rows, dedupe_token=token("anomalies", ids))
        # a waiting rank is a symptom of its culprit: stored with its role, never alerted or diagnosed
        alerts = [a for a in anomalies if a["role"] != WAITING]
        self.stats.waiting += len(anomalies) - len(alerts)
        out = self.diagnoser.handle(alerts, emitted_at_ns=now)
        self.stats.diagnoses += len(out.diagnoses)
        self.stats.unmatched += out.unmatched
        if out.rejected:
            log.warning("diagnosis rejected %d anomalies: %s", len(out.rejected), out.rejected[:3])
        if out.diagnoses:
            self.store.insert("diagnoses", out.columns, dedupe_token=token("diagnoses", ids))
        if self.producer is not None:
            for a in alerts:
                self.producer.produce(self.cfg.topic("anomalies"), key=f"{a['tenant']}/{a['job']}".encode(),
                                      value=json.dumps(a).encode(), headers=schema_header(ANOMALY_SCHEMA))
            for m in out.messages:
                self.producer.produce(self.cfg.topic("diagnoses"), key=f"{m['tenant']}/{m['job']}".encode(),
                                      value=json.dumps(m, default=float).encode(),
                                      headers=schema_header(DIAGNOSIS_SCHEMA))


def anomaly_record(w, s, vector: dict, role: str = "", culprits=(), joined_z=None, loud=None) -> dict:
    """A flagged window as streams.diagnosis.Anomaly's fields (plain JSON types)."""
    return {"tenant": w.key[0], "job": w.key[1], "host": w.key[2], "rank": int(w.key[3]),
            "window_start_ns": int(w.start_ns), "role": role, "culprit_ranks": [int(r) for r in culprits],
            "score": float(s.score),
            "threshold": float(s.threshold) if s.threshold is not None else float("nan"),
            "detectors": list(s.detectors),
            "contributions": {**{k: float(v) for k, v in s.contributions.items()},
                              **{k: float(v) for k, v in (loud or {}).items()}},
            "peer_z": {**{k: float(v) for k, v in (joined_z or {}).items()},
                       **{k: float(v) for k, v in s.peer_z.items()}},
            "features": {k: float(v) for k, v in vector.items()}}


def scores_batch(worker_host: str, scored) -> Batch:
    cols = {"window_start_ns": np.array([w.start_ns for w, _, _ in scored], dtype="<i8"),
            "tenant": StrColumn.of([w.key[0] for w, _, _ in scored]),
            "job": StrColumn.of([w.key[1] for w, _, _ in scored]),
            "host": StrColumn.of([w.key[2] for w, _, _ in scored]),
            "rank": np.array([w.key[3] for w, _, _ in scored], dtype="<i4"),
            "score": np.array([s.score for _, s, _ in scored], dtype="<f8"),
            "threshold": np.array([np.nan if s.threshold is None else s.threshold for _, s, _ in scored],
                                  dtype="<f8"),
            "is_anomaly": np.array([s.is_anomaly for _, s, _ in scored], dtype="<u1"),
            "role": StrColumn.of([role for _, _, role in scored]),
            "detectors": StrColumn.of([",".join(s.detectors) for _, s, _ in scored]),
            "warm": np.array([s.warm for _, s, _ in scored], dtype="<u1"),
            "emitted_at_ns": np.full(len(scored), time.time_ns(), dtype="<i8")}
    return Batch("scores", worker_host, cols)

-- One row per (anomalous window, KB entry it matched), or one row with
-- kb_entry = 'unmatched' when nothing in the knowledge base fits: an
-- unexplained anomaly stays visible. ReplacingMergeTree(emitted_at): a
-- window re-diagnosed after a rebalance keeps its newest row per entry.
CREATE TABLE IF NOT EXISTS {database}.diagnoses
(
    tenant        LowCardinality(String),
    job           LowCardinality(String),
    host          LowCardinality(String),
    rank          Int32,
    window_start  DateTime64(3, 'UTC'),
    kb_entry      LowCardinality(String) COMMENT '''unmatched'' when no KB entry matched',
    confidence    Float32 COMMENT 'in [0, 1]; 0 for unmatched',
    similarity    Float32 COMMENT 'fingerprint vs the entry''s pattern, in [-1, 1]',
    fingerprint   Map(LowCardinality(String), Float32) COMMENT 'signed subsystem shares; absolute values sum to 1',
    fingerprint_unsigned Array(LowCardinality(String)) COMMENT 'subsystems whose direction no peer z-score gave',
    evidence      Map(LowCardinality(String), Float64) COMMENT 'feature values, peer_z.<feature>, share.<feature>',
    rules_held    Array(String),
    detectors     Array(LowCardinality(String)),
    score         Float64,
    threshold     Float64,
    emitted_at    DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(emitted_at)
PARTITION BY toDate(window_start)
ORDER BY (tenant, job, rank, window_start, kb_entry)
TTL toDateTime(window_start) + INTERVAL {ttl_days} DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

-- Every remediation decision: dry runs, refusals and executions, with the
-- evidence from before and after. Inserted with the record id as dedupe token.
CREATE TABLE IF NOT EXISTS {database}.remediation_log
(
    ts              DateTime64(3, 'UTC'),
    record_id       String,
    action_id       String COMMENT 'same action (entry, target, command) across dry run and execution',
    tenant          LowCardinality(String),
    job             LowCardinality(String),
    host            LowCardinality(String),
    rank            Int32,
    window_start    DateTime64(3, 'UTC') COMMENT 'the diagnosed window that prompted the action',
    kb_entry        LowCardinality(String),
    mode            LowCardinality(String) COMMENT 'dry_run | refused | execute',
    status          LowCardinality(String) COMMENT 'planned | refused | ok | failed',
    command         String,
    reason          String,
    risk            LowCardinality(String),
    exit_code       Int32 COMMENT '-1 when nothing ran',
    stdout_head     String,
    stderr_head     String,
    evidence_before Map(String, String),
    evidence_after  Map(String, String),
    operator        String
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (tenant, job, host, ts)
TTL toDateTime(ts) + INTERVAL {ttl_days} DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

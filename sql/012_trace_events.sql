-- Per-call records the agents captured around anomalies (<prefix>.traces, fs-schema trace/1): one row per
-- call of the flagged rank within its window ± one window. ReplacingMergeTree(emitted_at) keyed by the call
-- itself (rank, process, thread, start, api): a call that two overlapping captures hold (adjacent flagged
-- windows) or a replayed message is one row under FINAL, filed under the newest capture's window.
CREATE TABLE IF NOT EXISTS {database}.trace_events
(
    tenant        LowCardinality(String),
    job           LowCardinality(String),
    host          LowCardinality(String),
    rank          Int32,
    window_start  DateTime64(3, 'UTC') COMMENT 'the anomaly window whose capture holds the call',
    source        LowCardinality(String) COMMENT 'the tracer: cuda or nccl',
    api           LowCardinality(String),
    pid           Int32,
    tid           Int32,
    ts            DateTime64(9, 'UTC') COMMENT 'call entry, ns since the Unix epoch',
    dur_ns        Int64,
    args          String COMMENT 'JSON object of what the tracer decoded: rc, bytes, kernel, grid, block, stream, ...',
    emitted_at    DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(emitted_at)
PARTITION BY toDate(ts)
ORDER BY (tenant, job, rank, ts, pid, tid, api)
TTL toDateTime(ts) + INTERVAL {ttl_days} DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

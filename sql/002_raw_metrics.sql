-- ReplacingMergeTree: the sort key is the full identity of an event, so two rows
-- with the same key can only be one event
-- delivered twice (a re-sent batch); merges fold them as a backstop.
-- Raw metric samples (gauges and deltas) from every source, one row per event.
-- ORDER BY follows the contract: low-cardinality tenant, job, then rank, then
-- event time. Sinks pass the batch id as insert_deduplication_token, and the
-- dedupe window makes a retried batch a no-op.
-- The TTL is on event time: rows older than {ttl_days} days are dropped, and
-- daily partitions let whole parts go at once.
CREATE TABLE IF NOT EXISTS {database}.raw_metrics
(
    source      LowCardinality(String),
    tenant      LowCardinality(String),
    job         LowCardinality(String),
    host        LowCardinality(String),
    rank        Int32,
    pid         Int32,
    gpu         Int16,
    ts          DateTime64(9, 'UTC') COMMENT 'event time, ns since the Unix epoch',
    metric      LowCardinality(String),
    device      LowCardinality(String),
    value       Float64,
    interval_ns Int64 COMMENT '0 for a gauge, else the span a delta covers',
    batch_id    String,
    ingested_at DateTime64(3, 'UTC') DEFAULT now64(3) COMMENT 'when the store accepted the row: ingest delay = ingested_at - ts'
)
ENGINE = ReplacingMergeTree
PARTITION BY toDate(ts)
ORDER BY (tenant, job, rank, ts, metric, device, pid, gpu)
TTL toDateTime(ts) + INTERVAL {ttl_days} DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

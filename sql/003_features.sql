-- ReplacingMergeTree(emitted_at): if a rebalance ever lets two workers emit the
-- same window, merges keep the newest. The worker itself never re-emits.
-- One feature vector per (tenant, job, rank, host, event-time window).
-- A feature that could not be computed (masked) is an absent key in
-- `feature`, never a zero: zero is a real measurement.
CREATE TABLE IF NOT EXISTS {database}.features
(
    tenant          LowCardinality(String),
    job             LowCardinality(String),
    host            LowCardinality(String),
    rank            Int32,
    window_start    DateTime64(3, 'UTC'),
    window_end      DateTime64(3, 'UTC'),
    feature_version UInt16,
    feature         Map(LowCardinality(String), Float64) COMMENT 'masked features are absent keys, never zeros',
    sources         Array(LowCardinality(String)) COMMENT 'sources that contributed events to this window',
    event_count     UInt32,
    emitted_at      DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(emitted_at)
PARTITION BY toDate(window_start)
ORDER BY (tenant, job, rank, window_start, host)
TTL toDateTime(window_start) + INTERVAL {ttl_days} DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

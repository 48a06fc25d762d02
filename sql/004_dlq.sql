-- Messages that could not be decoded or failed validation, with the reason.
-- Undecodable input has no tenant or job, so this table orders by topic, time.
-- payload_head keeps the first bytes (escaped) for diagnosis, never the whole message.
CREATE TABLE IF NOT EXISTS {database}.dlq
(
    ts           DateTime64(3, 'UTC') COMMENT 'when the worker rejected the message',
    topic        LowCardinality(String),
    partition    Int32,
    offset       Int64,
    reason       String,
    source       LowCardinality(String),
    host         LowCardinality(String),
    batch_id     String,
    size         UInt32,
    payload_head String
)
ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (topic, ts)
TTL toDateTime(ts) + INTERVAL {ttl_days} DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

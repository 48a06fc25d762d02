-- ClickHouse's Kafka table engine storing fleetscope's raw topics in raw_metrics: the alternative to
-- running `fleetscope sink` for raw topics, with a ClickHouse server only (chDB cannot consume Kafka).
--
-- Render it, do not edit it: `fleetscope db kafka-engine-sql --brokers HOST:PORT` prints it with every
-- placeholder filled from the configuration (src/fleetscope/store/kafka_engine.py checks each value):
--   {database}          the fleetscope database; `fleetscope db migrate` must have made raw_metrics first
--   {brokers}           kafka_broker_list, host:port[,host:port...] as the ClickHouse server reaches Kafka
--   {raw_topics}        kafka_topic_list: {prefix}.raw.<source> for every source the schema knows
--   {prefix}            the topic prefix (FLEETSCOPE_TOPIC_PREFIX)
--   {group}             kafka_group_name; default {prefix}-clickhouse-raw. Not the sink's group: both
--                       may read the raw topics at once (e.g. while switching), each storing everything
--   {num_consumers}     kafka_num_consumers per server; at most the raw topics' partitions
--   {schema_version}    the wire format version the fs-schema header must carry
--   {known_sources}     the sources the schema knows; {traced_sources} those that must carry sample_frac
--   {ttl_days} and {max_future_skew_ns}: the event-time bounds the worker's admission also applies
-- To remove: DROP the view first (it stops consuming), then the queue table.
--
-- How a message becomes rows. A raw message is one Arrow IPC stream (zstd buffers, dictionary-encoded
-- strings), which `kafka_format = 'ArrowStream'` reads, one message at a time, into the queue table's
-- columns by name. Every queue column is Nullable, so a column the stream lacks reads as NULL (Arrow's
-- missing columns are filled, input_format_arrow_allow_missing_columns) and the view can tell "absent"
-- from 0: an absent sample_frac means 1, an absent pod/namespace/container means '', an absent required
-- column rejects the message. The batch's facts that travel in the Arrow schema's metadata (source,
-- host, batch_id) are not visible to SQL; the view takes them from the Kafka headers that repeat them
-- (fs-source, fs-host, fs-batch, and fs-schema for the version). ts_ns becomes ts (DateTime64(9)).
--
-- What the view checks, per message, all or nothing (one bad row rejects its whole message, as the
-- worker does): it parsed (kafka_handle_error_mode = 'stream': a message that does not parse becomes one
-- row with _error set, instead of stopping the consumer); the fs-schema header is {schema_version}; the
-- source is known; the required columns are there (sample_frac too for traced sources); tenant, job,
-- host, source and batch_id are non-empty; every string is valid UTF-8, at most 256 characters, free of
-- control characters; the Kafka key is the rows' tenant/job; event times lie within the retention and
-- at most the allowed skew ahead of the server's clock.
--
-- What it does NOT do, that `fleetscope sink` does; say so to whoever chooses this path:
--   * No dead letters from here: a rejected message is dropped by the view, without a row anywhere.
--     The stream worker reads the same raw topics and dead-letters the same messages (with its reason)
--     on <prefix>.dlq, which `fleetscope sink` stores in dlq. So keep the sinks for derived topics, the
--     DLQ and model state, started as `fleetscope sink --no-raw`: a sink without it stores raw rows too.
--   * No checksum: the CRC-32 in the Arrow metadata is not checked (SQL cannot see it), so a corrupted
--     message that still parses (most single bit flips in a zstd stream do) is stored as it reads.
--     Nor does it check that the headers agree with the payload's own metadata.
--   * No exactly-once: the engine commits offsets after the block is written, so a server restart in
--     between stores a block twice. There is no per-batch insert_deduplication_token and no replay check
--     against batch ids already stored; raw_metrics' ReplacingMergeTree folds the duplicate rows (same
--     sort key) at merge time only, so exact counts need FINAL. (Newer servers can keep the offsets in
--     Keeper, kafka_keeper_path; not used here.)
--   * No per-batch isolation of a store rejection and no backpressure or retry policy of ours: the
--     engine retries a failing block itself, and logs to the server's log and system.kafka_consumers.
--   * Rows arrive in blocks (kafka_max_block_size messages or kafka_flush_interval_ms, 7.5 s by
--     default), not per poll.
-- Kafka engine storage of ArrowStream messages: ClickHouse reads them since ClickHouse PR 23415 (2021).

CREATE TABLE IF NOT EXISTS {database}.raw_kafka_queue
(
    ts_ns       Nullable(Int64),
    tenant      LowCardinality(Nullable(String)),
    job         LowCardinality(Nullable(String)),
    rank        Nullable(Int32),
    pid         Nullable(Int32),
    gpu         Nullable(Int16),
    pod         LowCardinality(Nullable(String)),
    namespace   LowCardinality(Nullable(String)),
    container   LowCardinality(Nullable(String)),
    metric      LowCardinality(Nullable(String)),
    device      LowCardinality(Nullable(String)),
    value       Nullable(Float64),
    interval_ns Nullable(Int64),
    sample_frac Nullable(Float64)
)
ENGINE = Kafka
SETTINGS kafka_broker_list = '{brokers}',
         kafka_topic_list = '{raw_topics}',
         kafka_group_name = '{group}',
         kafka_format = 'ArrowStream',
         kafka_num_consumers = {num_consumers},
         kafka_handle_error_mode = 'stream',
         input_format_arrow_allow_missing_columns = 1;

-- Rows of messages that pass every check, as raw_metrics rows (ingested_at takes its default, now64(3)).
-- The window function spans one message (topic, partition, offset): a message is never split between
-- the engine's blocks, so its rows are judged together.
CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.raw_kafka_to_raw_metrics TO {database}.raw_metrics
AS SELECT source, tenant_v AS tenant, job_v AS job, host, rank_v AS rank, pid_v AS pid, gpu_v AS gpu,
          pod_v AS pod, namespace_v AS namespace, container_v AS container, ts, metric_v AS metric,
          device_v AS device, value_v AS value, interval_ns_v AS interval_ns, sample_frac_v AS sample_frac, batch_id
FROM
(
    SELECT *, max(reject) OVER (PARTITION BY msg_topic, msg_partition, msg_offset) AS message_reject
    FROM
    (
        SELECT
            _topic AS msg_topic, _partition AS msg_partition, _offset AS msg_offset,
            _headers.value[indexOf(_headers.name, 'fs-source')] AS source,
            _headers.value[indexOf(_headers.name, 'fs-host')] AS host,
            _headers.value[indexOf(_headers.name, 'fs-batch')] AS batch_id,
            _headers.value[indexOf(_headers.name, 'fs-schema')] AS wire_version,
            toString(ifNull(tenant, '')) AS tenant_v, toString(ifNull(job, '')) AS job_v,
            toString(ifNull(pod, '')) AS pod_v, toString(ifNull(namespace, '')) AS namespace_v,
            toString(ifNull(container, '')) AS container_v,
            toString(ifNull(metric, '')) AS metric_v, toString(ifNull(device, '')) AS device_v,
            assumeNotNull(rank) AS rank_v, assumeNotNull(pid) AS pid_v, assumeNotNull(gpu) AS gpu_v,
            assumeNotNull(value) AS value_v, assumeNotNull(interval_ns) AS interval_ns_v,
            ifNull(sample_frac, 1.0) AS sample_frac_v,
            fromUnixTimestamp64Nano(assumeNotNull(ts_ns), 'UTC') AS ts,
            toUnixTimestamp64Nano(now64(9, 'UTC')) AS now_ns,
            multiIf(
                _error != '', concat('unreadable: ', _error),
                wire_version != '{schema_version}', 'fs-schema header is not {schema_version}',
                source NOT IN ({known_sources}), 'unknown source',
                isNull(ts_ns) OR isNull(tenant) OR isNull(job) OR isNull(rank) OR isNull(pid) OR isNull(gpu)
                    OR isNull(metric) OR isNull(device) OR isNull(value) OR isNull(interval_ns),
                    'a required column is missing',
                source IN ({traced_sources}) AND isNull(sample_frac), 'a traced source lacks sample_frac',
                arrayExists(s -> s = '', [source, host, batch_id, tenant_v, job_v]), 'an identity string is empty',
                arrayExists(s -> NOT isValidUTF8(s) OR lengthUTF8(s) > 256 OR match(s, '[\\x00-\\x1f\\x7f-\\x{9f}]'),
                            [source, host, batch_id, tenant_v, job_v, metric_v, device_v, pod_v, namespace_v,
                             container_v]),
                    'a string is not valid UTF-8, too long, or holds a control character',
                _key != concat(tenant_v, '/', job_v), 'the Kafka key is not the rows'' tenant/job',
                ts_ns > now_ns + {max_future_skew_ns}, 'event time too far ahead of the server clock',
                ts_ns < now_ns - {ttl_days} * 86400000000000, 'event time older than the retention',
                '') AS reject
        FROM {database}.raw_kafka_queue
    )
)
WHERE message_reject = '';

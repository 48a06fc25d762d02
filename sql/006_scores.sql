-- Every scored (rank, window): the model's score (negative log-likelihood
-- under the job's mixture), the threshold in force (nan during warm-up) and
-- which detectors fired. ReplacingMergeTree(emitted_at) as for features.
CREATE TABLE IF NOT EXISTS {database}.scores
(
    tenant        LowCardinality(String),
    job           LowCardinality(String),
    host          LowCardinality(String),
    rank          Int32,
    window_start  DateTime64(3, 'UTC'),
    score         Float64 COMMENT 'negative log-likelihood under the job model',
    threshold     Float64 COMMENT 'nan while the job model warms up (see warm)',
    is_anomaly    UInt8,
    detectors     Array(LowCardinality(String)) COMMENT 'detectors that fired: gmm, peer, hst, mahalanobis',
    warm          UInt8,
    emitted_at    DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(emitted_at)
PARTITION BY toDate(window_start)
ORDER BY (tenant, job, rank, window_start, host)
TTL toDateTime(window_start) + INTERVAL {ttl_days} DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

-- Flagged windows only, with what made them anomalous: the features that
-- contributed most to the score and the largest peer z-scores (this rank vs
-- the job's median rank in the same window), plus the whole feature vector.
CREATE TABLE IF NOT EXISTS {database}.anomalies
(
    tenant        LowCardinality(String),
    job           LowCardinality(String),
    host          LowCardinality(String),
    rank          Int32,
    window_start  DateTime64(3, 'UTC'),
    score         Float64,
    threshold     Float64,
    detectors     Array(LowCardinality(String)),
    contributions Map(LowCardinality(String), Float64) COMMENT 'top features by contribution to the score',
    peer_z        Map(LowCardinality(String), Float64) COMMENT 'top features by |robust z| against the job''s ranks',
    feature       Map(LowCardinality(String), Float64) COMMENT 'the window''s vector; masked features absent',
    emitted_at    DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(emitted_at)
PARTITION BY toDate(window_start)
ORDER BY (tenant, job, rank, window_start, host)
TTL toDateTime(window_start) + INTERVAL {ttl_days} DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

-- The newest checkpoint of each job's model, so a restarted or rebalanced
-- worker resumes instead of relearning from zero. `state` is the model's
-- versioned binary form (JobModel.to_bytes), base64 text.
CREATE TABLE IF NOT EXISTS {database}.model_state
(
    tenant        LowCardinality(String),
    job           LowCardinality(String),
    saved_at      DateTime64(3, 'UTC'),
    last_window   DateTime64(3, 'UTC'),
    state         String CODEC(ZSTD(3))
)
ENGINE = ReplacingMergeTree(saved_at)
ORDER BY (tenant, job);

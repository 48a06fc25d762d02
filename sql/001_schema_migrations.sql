-- Which numbered migrations have run. The store records a row here after a
-- migration's statements succeed; a retried record dedupes on its token.
-- No TTL: this history must outlive the data.
CREATE TABLE IF NOT EXISTS {database}.schema_migrations
(
    version    UInt32,
    name       String,
    applied_at DateTime DEFAULT now()
)
ENGINE = MergeTree
ORDER BY version
SETTINGS non_replicated_deduplication_window = 10000;

-- Traced sources (cuda, nccl, python, torch) duty-cycle their probes under an
-- overhead budget; each row records the fraction of its interval the probe
-- family was attached. Counts scale by 1/sample_frac to estimate true rates.
-- Sources that see every event (host, nvml, kernel, agent) store 1.
ALTER TABLE {database}.raw_metrics
    ADD COLUMN IF NOT EXISTS sample_frac Float64 DEFAULT 1 COMMENT 'fraction of the interval the probe family was attached; 1 = all events' AFTER interval_ns;

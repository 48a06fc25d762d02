-- The role of a flagged rank-window (streams/model/roles.py): culprit (the rank
-- the job waits for), waiting (a peer waiting on a culprit in collectives:
-- shown in scores, never alerted), node (the node's own model flagged the
-- window), job (the job's rate changed, no rank differs). '' when not flagged.
ALTER TABLE {database}.scores
    ADD COLUMN IF NOT EXISTS role LowCardinality(String) DEFAULT '' COMMENT 'culprit, waiting, node, job; empty when not flagged' AFTER is_anomaly;

ALTER TABLE {database}.anomalies
    ADD COLUMN IF NOT EXISTS role LowCardinality(String) DEFAULT '' COMMENT 'culprit, waiting, node, job' AFTER detectors;

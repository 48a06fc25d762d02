-- The worker's window marks beside each job's model checkpoint, as the sink mirrors them from
-- <prefix>.model-state (JSON: per host and rank, the newest window start emitted). A processor run
-- in-process with its sink reads them back from here; workers read the topic.
ALTER TABLE {database}.model_state
    ADD COLUMN IF NOT EXISTS marks String DEFAULT '' COMMENT 'model-state/1 JSON without the model: window marks per host and rank';

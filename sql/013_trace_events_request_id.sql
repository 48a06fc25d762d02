-- Which live capture request (fleetscope trace --live, <prefix>.control, capture-request/1) a stored call's
-- capture answered: the piece's request_id (trace/1). Captures around anomalies carry none and store '', as do
-- rows stored before this column. Not in the sort key: a call is one row under FINAL whichever captures hold it,
-- and that row keeps the newest capture's request_id (a call both a request and a later anomaly capture hold
-- reads as the anomaly's).
ALTER TABLE {database}.trace_events
    ADD COLUMN IF NOT EXISTS request_id String DEFAULT '' COMMENT 'the live capture request this call''s capture answered; empty: a capture around an anomaly' AFTER window_start;

-- Diagnoses per knowledge-base entry in the last {hours} hours: how many anomalous windows each entry
-- explained, across how many jobs, with its mean confidence. 'unmatched' counts the anomalies nothing fits.
-- fleetscope query --file sql/queries/diagnoses_by_kb_entry.sql --param hours=24
SELECT
    kb_entry,
    count() AS windows,
    uniqExact(tenant, job) AS jobs,
    round(avg(confidence), 3) AS mean_confidence,
    max(window_start) AS last_seen
FROM diagnoses FINAL
WHERE window_start >= now() - INTERVAL {hours:UInt32} HOUR
GROUP BY kb_entry
ORDER BY windows DESC, kb_entry

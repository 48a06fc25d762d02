-- Dead letters in the last {hours} hours by reason and topic: what the workers refused and how much of it.
-- fleetscope query --file sql/queries/dlq_by_reason.sql --param hours=24
SELECT
    reason,
    topic,
    count() AS messages,
    sum(size) AS bytes,
    uniqExact(host) AS hosts,
    max(ts) AS last_seen
FROM dlq
WHERE ts >= now() - INTERVAL {hours:UInt32} HOUR
GROUP BY reason, topic
ORDER BY messages DESC, reason, topic

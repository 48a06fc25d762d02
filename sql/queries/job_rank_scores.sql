-- Grafana, job view: each rank's score and the threshold in force over time (threshold nan while warming up).
SELECT
    $__timeInterval(window_start) AS time,
    concat('rank ', toString(rank)) AS rank,
    max(score) AS score,
    max(threshold) AS threshold
FROM scores FINAL
WHERE tenant = ${tenant:sqlstring} AND job = ${job:sqlstring} AND $__timeFilter(window_start)
GROUP BY time, rank
ORDER BY time, rank

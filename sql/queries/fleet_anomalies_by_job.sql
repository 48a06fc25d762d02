-- Grafana, fleet overview: flagged rank-windows per tenant/job over time.
SELECT
    $__timeInterval(window_start) AS time,
    concat(tenant, '/', job) AS job,
    count() AS anomalies
FROM anomalies FINAL
WHERE $__timeFilter(window_start)
GROUP BY time, job
ORDER BY time, job

-- Grafana, fleet overview: flagged rank-windows per tenant/job over time. A peer flagged only because it
-- waits on a culprit (role `waiting`) is stored beside the anomalies but is not one: it is left out.
SELECT
    $__timeInterval(window_start) AS time,
    concat(tenant, '/', job) AS job,
    count() AS anomalies
FROM anomalies FINAL
WHERE $__timeFilter(window_start) AND role != 'waiting'
GROUP BY time, job
ORDER BY time, job

-- Grafana, fleet overview: nodes whose ranks were flagged, with their GPU throttling in the same range.
-- A node appears here when ranks it hosts were flagged as culprits, or with role `node` or `job` (a peer that
-- only waits on a culprit elsewhere does not count), and throttled_windows counts its node windows with a
-- clock-limiting throttle reason.
SELECT
    a.host AS host,
    a.anomalies AS anomalies,
    a.flagged_ranks AS flagged_ranks,
    a.jobs AS jobs,
    ifNull(n.throttled_windows, 0) AS throttled_windows
FROM
(
    SELECT host, count() AS anomalies, uniqExact(tenant, job, rank) AS flagged_ranks,
           arrayStringConcat(arraySort(groupUniqArray(concat(tenant, '/', job))), ', ') AS jobs
    FROM anomalies FINAL
    WHERE $__timeFilter(window_start) AND role != 'waiting'
    GROUP BY host
) AS a
LEFT JOIN
(
    SELECT host, countIf(feature['gpu_throttled'] > 0) AS throttled_windows
    FROM features FINAL
    WHERE tenant = '_node' AND $__timeFilter(window_start)
    GROUP BY host
) AS n ON n.host = a.host
ORDER BY anomalies DESC, host

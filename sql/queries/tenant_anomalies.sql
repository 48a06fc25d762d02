-- The anomalies of one tenant in the last {hours} hours, newest first, with their role (culprit, node, job)
-- and the features that contributed most to each score. Peers that only wait on a culprit are left out.
-- fleetscope query --file sql/queries/tenant_anomalies.sql --param tenant=T --param hours=24
SELECT
    window_start,
    job,
    host,
    rank,
    role,
    round(score, 3) AS score,
    round(threshold, 3) AS threshold,
    detectors,
    arrayStringConcat(arraySlice(arrayReverseSort(x -> contributions[x], mapKeys(contributions)), 1, 3), ', ')
        AS top_features
FROM anomalies FINAL
WHERE tenant = {tenant:String} AND role != 'waiting'
  AND window_start >= now() - INTERVAL {hours:UInt32} HOUR
ORDER BY window_start DESC, job, rank
LIMIT 1000

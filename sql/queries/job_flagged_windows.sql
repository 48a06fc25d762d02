-- Grafana, job view: the job's flagged windows, newest first, each with its role: culprit (the rank the job
-- waits for), waiting (a peer waiting on it: shown, never alerted), node or job (streams/model/roles.py).
SELECT
    window_start,
    rank,
    role,
    host,
    round(score, 3) AS score,
    round(threshold, 3) AS threshold,
    arrayStringConcat(detectors, ', ') AS detectors,
    arrayStringConcat(arraySlice(arrayReverseSort(x -> contributions[x], mapKeys(contributions)), 1, 3), ', ')
        AS top_features
FROM anomalies FINAL
WHERE tenant = ${tenant:sqlstring} AND job = ${job:sqlstring} AND $__timeFilter(window_start)
ORDER BY window_start DESC, rank
LIMIT 500

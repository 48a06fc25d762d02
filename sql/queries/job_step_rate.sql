-- Grafana, job view: collectives per second per rank, the step-rate proxy (DDP issues a fixed number of
-- collectives per step, so this moves with the step rate). The agent does not measure steps themselves.
SELECT
    $__timeInterval(window_start) AS time,
    concat('rank ', toString(rank)) AS rank,
    avg(feature['nccl_calls_per_s']) AS collectives_per_s
FROM features FINAL
WHERE tenant = ${tenant:sqlstring} AND job = ${job:sqlstring} AND mapContains(feature, 'nccl_calls_per_s')
  AND $__timeFilter(window_start)
GROUP BY time, rank
ORDER BY time, rank

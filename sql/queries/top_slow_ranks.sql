-- The ranks of one job that the model flagged most in the last {hours} hours, slowest first.
-- A straggler is flagged more often and scores higher than its peers; it also waits least in collectives
-- (its peers wait for it), so a low nccl_time_frac beside a high flag count points at the slow rank itself.
-- flagged_windows leaves out the windows a rank was flagged only as waiting on a culprit (waiting_windows).
-- fleetscope query --file sql/queries/top_slow_ranks.sql --param tenant=T --param job=J --param hours=1
SELECT
    s.rank AS rank,
    any(s.host) AS host,
    count() AS windows,
    countIf(s.is_anomaly = 1 AND s.role != 'waiting') AS flagged_windows,
    countIf(s.role = 'waiting') AS waiting_windows,
    round(avgIf(s.score, isFinite(s.score)), 3) AS mean_score,
    round(avgIf(s.score - s.threshold, isFinite(s.threshold)), 3) AS mean_excess_over_threshold,
    round(avgIf(f.feature['nccl_time_frac'], mapContains(f.feature, 'nccl_time_frac')), 4) AS mean_nccl_time_frac
FROM scores AS s FINAL
LEFT JOIN (SELECT tenant, job, rank, window_start, feature FROM features FINAL
           WHERE tenant = {tenant:String} AND job = {job:String}
             AND window_start >= now() - INTERVAL {hours:UInt32} HOUR) AS f
    ON f.tenant = s.tenant AND f.job = s.job AND f.rank = s.rank AND f.window_start = s.window_start
WHERE s.tenant = {tenant:String} AND s.job = {job:String}
  AND s.window_start >= now() - INTERVAL {hours:UInt32} HOUR
GROUP BY s.rank
ORDER BY flagged_windows DESC, mean_score DESC, rank
LIMIT 10

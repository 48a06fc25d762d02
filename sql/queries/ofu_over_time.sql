-- OFU (overall FLOP utilization, %) per node over time: node windows' gpu_ofu (the mean over the node's GPUs),
-- averaged in buckets of {bucket_s} seconds over the last {hours} hours. GPUs without GPM (pre-Hopper) have
-- no OFU, so their nodes are absent rather than at zero.
-- fleetscope query --file sql/queries/ofu_over_time.sql --param hours=1 --param bucket_s=60
SELECT
    toStartOfInterval(window_start, toIntervalSecond({bucket_s:UInt32})) AS bucket,
    host,
    round(avg(feature['gpu_ofu']), 2) AS ofu_percent,
    count() AS windows
FROM features FINAL
WHERE tenant = '_node' AND mapContains(feature, 'gpu_ofu')
  AND window_start >= now() - INTERVAL {hours:UInt32} HOUR
GROUP BY bucket, host
ORDER BY bucket, host

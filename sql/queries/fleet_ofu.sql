-- Grafana, fleet overview: OFU (%) per node over time (GPM GPUs only; others are absent, not zero).
SELECT
    $__timeInterval(window_start) AS time,
    host,
    avg(feature['gpu_ofu']) AS ofu_percent
FROM features FINAL
WHERE tenant = '_node' AND mapContains(feature, 'gpu_ofu') AND $__timeFilter(window_start)
GROUP BY time, host
ORDER BY time, host

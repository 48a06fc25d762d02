-- Grafana, node view: the node's host features over time (CPU, memory, NUMA, scheduling).
SELECT
    $__timeInterval(window_start) AS time,
    name,
    avg(feature[name]) AS value
FROM features FINAL
ARRAY JOIN ['cpu_busy_frac', 'cpu_busy_max_core_frac', 'mem_used_frac', 'numa_miss_ratio',
            'context_switches_per_s'] AS name
WHERE tenant = '_node' AND job = ${host:sqlstring} AND mapContains(feature, name) AND $__timeFilter(window_start)
GROUP BY time, name
ORDER BY time, name

-- Grafana, node view: the node's GPU features over time (utilization, power, energy, OFU, throttling).
SELECT
    $__timeInterval(window_start) AS time,
    name,
    avg(feature[name]) AS value
FROM features FINAL
ARRAY JOIN ['gpu_util', 'gpu_power_w', 'gpu_energy_j', 'gpu_ofu', 'gpu_tensor_util', 'gpu_throttled'] AS name
WHERE tenant = '_node' AND job = ${host:sqlstring} AND mapContains(feature, name) AND $__timeFilter(window_start)
GROUP BY time, name
ORDER BY time, name

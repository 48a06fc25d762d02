-- Grafana, fleet overview: GPU energy (kWh) per tenant/job in the dashboard's range.
SELECT
    concat(tenant, '/', job) AS job,
    sum(feature['gpu_energy_j']) / 3.6e6 AS energy_kwh
FROM features FINAL
WHERE tenant != '_node' AND mapContains(feature, 'gpu_energy_j') AND $__timeFilter(window_start)
GROUP BY job
ORDER BY energy_kwh DESC, job

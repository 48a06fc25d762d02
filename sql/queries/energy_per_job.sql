-- GPU energy per job in the last {hours} hours: the sum of its ranks' windows' gpu_energy_j (each process's
-- share of its GPU's energy, split by SM utilization in the agent). Windows without GPU telemetry are masked
-- (no key), never counted as zero: gpu_windows says how many windows carried a value.
-- fleetscope query --file sql/queries/energy_per_job.sql --param hours=24
SELECT
    tenant,
    job,
    round(sumIf(feature['gpu_energy_j'], mapContains(feature, 'gpu_energy_j')), 3) AS energy_j,
    round(energy_j / 3.6e6, 6) AS energy_kwh,
    countIf(mapContains(feature, 'gpu_energy_j')) AS gpu_windows,
    uniqExact(rank) AS ranks
FROM features FINAL
WHERE tenant != '_node'
  AND window_start >= now() - INTERVAL {hours:UInt32} HOUR
GROUP BY tenant, job
ORDER BY energy_j DESC, tenant, job

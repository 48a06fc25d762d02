-- Grafana, fleet overview: anomalous windows per knowledge-base entry ('unmatched': nothing fits), per tenant.
SELECT
    kb_entry,
    tenant,
    count() AS windows,
    uniqExact(job) AS jobs,
    round(avg(confidence), 3) AS mean_confidence
FROM diagnoses FINAL
WHERE $__timeFilter(window_start)
GROUP BY kb_entry, tenant
ORDER BY windows DESC, kb_entry, tenant

-- Grafana, job view: the job's diagnoses with the rules that held and the evidence they rest on.
SELECT
    window_start,
    rank,
    host,
    kb_entry,
    round(confidence, 3) AS confidence,
    arrayStringConcat(rules_held, '; ') AS rules_held,
    arrayStringConcat(arrayMap(k -> concat(k, '=', toString(round(evidence[k], 4))), arraySort(mapKeys(evidence))),
                      ', ') AS evidence
FROM diagnoses FINAL
WHERE tenant = ${tenant:sqlstring} AND job = ${job:sqlstring} AND $__timeFilter(window_start)
ORDER BY window_start DESC, rank, kb_entry
LIMIT 500

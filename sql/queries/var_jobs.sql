-- Grafana variable `job`: the chosen tenant's jobs with scored windows in the dashboard's range.
SELECT DISTINCT job FROM scores WHERE tenant = ${tenant:sqlstring} AND $__timeFilter(window_start) ORDER BY job

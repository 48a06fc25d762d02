-- Grafana variable `tenant`: the tenants with scored windows in the dashboard's range.
SELECT DISTINCT tenant FROM scores WHERE $__timeFilter(window_start) ORDER BY tenant

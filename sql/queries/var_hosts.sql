-- Grafana variable `host`: the nodes with node windows in the dashboard's range.
SELECT DISTINCT host FROM features WHERE tenant = '_node' AND $__timeFilter(window_start) ORDER BY host

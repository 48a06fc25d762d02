-- Where each raw event's process ran, where the agent knows it (producers/identity.py Identity.placement):
-- its Kubernetes pod (name, else the UID its cgroup names), the pod's namespace, and its container (name,
-- else the short container id). Node rows and processes outside any pod or container store ''. Not in the
-- sort key: a process keeps one placement, so (tenant, job, rank, ts, metric, device, pid, gpu) stays unique.
ALTER TABLE {database}.raw_metrics
    ADD COLUMN IF NOT EXISTS pod LowCardinality(String) DEFAULT '' COMMENT 'pod name, else pod UID; empty outside Kubernetes' AFTER gpu,
    ADD COLUMN IF NOT EXISTS namespace LowCardinality(String) DEFAULT '' COMMENT 'the pod''s namespace, where known' AFTER pod,
    ADD COLUMN IF NOT EXISTS container LowCardinality(String) DEFAULT '' COMMENT 'container name, else short container id' AFTER namespace;

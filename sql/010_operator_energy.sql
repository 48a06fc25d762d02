-- Energy per operator (streams/energy_features.py): per (tenant, job, rank, window), the rank's GPU energy
-- split over the operators that ran there by their share of GPU-busy time, once per basis:
-- basis 'torch' weighs PyTorch ops by torch.op_ns, basis 'cuda' weighs kernel names by launch time
-- (launches x mean launch call time). '(idle)' holds the energy drawn while no kernel of the rank ran
-- (1 - SM utilization), '(other)' the operators past the 24 heaviest. `collectives` and `ops` are the
-- window's work (NCCL collective calls; torch op calls, else kernel launches), repeated on each of its rows,
-- so two runs can be compared per unit of work (`fleetscope energy diff`). An approximation: README,
-- Energy per operator.
CREATE TABLE IF NOT EXISTS {database}.operator_energy
(
    tenant       LowCardinality(String),
    job          LowCardinality(String),
    host         LowCardinality(String),
    rank         Int32,
    window_start DateTime64(3, 'UTC'),
    window_end   DateTime64(3, 'UTC'),
    basis        LowCardinality(String) COMMENT 'torch: ops by torch.op_ns; cuda: kernels by launch time',
    operator     String,
    busy_ns      Float64 COMMENT 'the weight: op time, or launches x mean launch call time; 0 for (idle)',
    share        Float64 COMMENT 'of the rank''s GPU energy in the window',
    energy_j     Float64,
    collectives  Float64 COMMENT 'NCCL collective calls of the rank in the window',
    ops          Float64 COMMENT 'torch op calls (else CUDA launches) of the rank in the window',
    emitted_at   DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(emitted_at)
PARTITION BY toDate(window_start)
ORDER BY (tenant, job, rank, window_start, host, basis, operator)
TTL toDateTime(window_start) + INTERVAL {ttl_days} DAY
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1;

"""Benchmarks, the evaluation harness and its workloads (run by `fleetscope bench` and `fleetscope demo`)."""

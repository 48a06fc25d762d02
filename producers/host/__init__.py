"""Host telemetry: one collector per file (see collector.py), gathered by sampler.HostSampler."""

"""The per-job anomaly model: incremental GMM, DSPOT thresholds, peers, ensemble, checkpoints."""
from fleetscope.streams.model.config import ModelConfig, WindowScore
from fleetscope.streams.model.job_model import JobModel

__all__ = ["JobModel", "ModelConfig", "WindowScore"]

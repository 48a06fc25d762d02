"""Every detector the job model can run, one line each, in the order WindowScore.detectors lists them.

An entry maps the name used in ModelConfig.detectors and in ensemble rules to a
factory taking the ModelConfig. The names list (ensemble.DETECTORS) is derived
from here. PRIMARY is the detector whose score and threshold every WindowScore
reports (and whose calibration ends the warm-up); ModelConfig requires it.
A detector that is not built never appears in WindowScore.detectors, and the
evaluation reports a rule that needs it as "not run" (ran_detectors).
"""
from __future__ import annotations

from typing import Callable

from fleetscope.streams.model.detector import Detector
from fleetscope.streams.model.half_space_trees import HalfSpaceDetector
from fleetscope.streams.model.mahalanobis import MahalanobisDetector
from fleetscope.streams.model.mixture_detector import MixtureDetector
from fleetscope.streams.model.peers import PeerDetector

REGISTRY: dict[str, Callable[..., Detector]] = {
    "gmm": MixtureDetector.from_config,
    "peer": PeerDetector.from_config,
    "hst": HalfSpaceDetector.from_config,
    "mahalanobis": MahalanobisDetector.from_config,
}
PRIMARY = "gmm"
# run whatever the config says: the primary's score, and the peers' z-scores that every
# WindowScore carries and diagnosis reads (the KB's peer_z conditions)
ALWAYS_RUN = (PRIMARY, "peer")


def build(config) -> dict[str, Detector]:
    """The detectors ``config.detectors`` names, and those that always run, in registry order."""
    return {name: make(config) for name, make in REGISTRY.items()
            if name in config.detectors or name in ALWAYS_RUN}

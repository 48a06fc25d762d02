"""Which Python function a rank is in: a categorical feature for telling a hung job's stuck rank apart.

When a collective hangs, every rank stops completing collectives at once
(streams/model/loud.py, ``hung``): the rank that never entered the collective
and the ranks blocked in it look the same in the call rates. Their stacks do
not: the waiting ranks sit in the same collective call, the stuck one
elsewhere (ByteRobust and Mycroft dump every rank's stack and group the
identical ones). The py-spy sampler (producers/tracers/python_sampler.py)
already reports, per rank and sampler window, the share of samples with each
"module:function" as the innermost frame (``python.sample_self_share``).

``python_top_frame_id`` is that top function's name as a number: the
unsigned CRC-32 of "module:function". The name is the same in every rank of
one program, so equal ids mean the same function across processes and hosts;
the number itself means nothing (a category), so it is kept out of every
model and peer z (``model_input``, feature_catalogue.CATEGORICAL_FEATURES).

py-spy does not sample idle threads (blocked in a syscall or a lock wait), and
a rank blocked in a gloo or NCCL wait is idle the whole time: a sampler window
that read no stack at all (``python.samples`` = 0) is a signature of its own,
``IDLE_FRAME_ID``. A window with samples but no frame left after the
configured prefixes, or with no sampler rows, has no signature (masked).

A sampler window (5 s by default) that straddles the start of a hang mixes
stacks from before and after it; the loud check reads each rank's latest
signature inside the silence, so such a window is superseded by the next.
"""
from __future__ import annotations

import zlib
from typing import Mapping

from fleetscope.streams.feature_catalogue import CATEGORICAL_FEATURES
from fleetscope.streams.windows import Window

SOURCE = "python_sampler"
FEATURE = "python_top_frame_id"
IDLE_FRAME = "<idle>"   # no stack sampled in the whole sampler window: every thread blocked


def frame_id(name: str) -> float:
    """A stable id of a "module:function" name, equal across processes (CRC-32, not Python's salted hash)."""
    return float(zlib.crc32(name.encode("utf-8", "surrogateescape")))


IDLE_FRAME_ID = frame_id(IDLE_FRAME)


def top_frame_features(w: Window) -> dict[str, float]:
    """``python_top_frame_id`` of the rank's window: the function with the largest mean self share of the
    sampler's windows inside this one (ties by name, so every rank picks alike); idle if none was sampled."""
    if SOURCE not in w.sources:
        return {}
    shares = [(a.gauge_sum / a.gauge_n, a.device) for a in w.devices(SOURCE, "python.sample_self_share")
              if a.gauge_n]
    if shares:
        top = max(shares, key=lambda sd: (sd[0], sd[1]))
        return {FEATURE: frame_id(top[1])}
    samples = [a for a in w.devices(SOURCE, "python.samples") if a.interval_ns > 0]
    if samples and sum(a.delta_sum for a in samples) == 0:
        return {FEATURE: IDLE_FRAME_ID}
    return {}


def model_input(vector: Mapping[str, float]) -> dict[str, float]:
    """The vector a numeric model sees: without categorical features (ids, not quantities)."""
    return {k: v for k, v in vector.items() if k not in CATEGORICAL_FEATURES}

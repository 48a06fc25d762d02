"""Which Python function a rank is in: a categorical feature for telling a hung job's stuck rank apart.

When a collective hangs, every rank stops completing collectives at once
(streams/model/loud.py, ``hung``): the rank that never entered the collective
and the ranks blocked in it look the same in the call rates. Their stacks do
not: the waiting ranks sit in the same collective call, the stuck one
elsewhere (ByteRobust and Mycroft dump every rank's stack and group the
identical ones). At the end of each of its windows the py-spy sampler
(producers/tracers/python_sampler.py) dumps each rank's main thread and
reports its innermost "module:function" (``python.stack_top``), idle or not:
a rank blocked in a gloo or NCCL wait is idle, which py-spy's sampled shares
leave out, so those cannot tell a sleeping stuck rank from blocked peers
(measured: a process in a time.sleep loop and one blocked in recv both read
no samples at all).

``python_top_frame_id`` is that function's name as a number: the unsigned
CRC-32 of "module:function". The name is the same in every rank of one
program, so equal ids mean the same function across processes and hosts; the
number itself means nothing (a category), so it is kept out of every model
and peer z (``model_input``, feature_catalogue.CATEGORICAL_FEATURES). A
window with no dump, or with two different ones (a window longer than the
sampler's), has none (masked).
"""
from __future__ import annotations

import zlib
from typing import Mapping

from fleetscope.streams.feature_catalogue import NOT_MODEL_INPUTS
from fleetscope.streams.windows import Window

SOURCE = "python_sampler"
FEATURE = "python_top_frame_id"


def frame_id(name: str) -> float:
    """A stable id of a "module:function" name, equal across processes (CRC-32, not Python's salted hash)."""
    return float(zlib.crc32(name.encode("utf-8", "surrogateescape")))


def top_frame_features(w: Window) -> dict[str, float]:
    """``python_top_frame_id`` of the rank's window: the function its main thread was in when the sampler's
    window ended; none if the window holds no dump or two that differ."""
    if SOURCE not in w.sources:
        return {}
    tops = {a.device for a in w.devices(SOURCE, "python.stack_top") if a.gauge_n}
    return {FEATURE: frame_id(tops.pop())} if len(tops) == 1 else {}


def model_input(vector: Mapping[str, float]) -> dict[str, float]:
    """The vector a numeric model sees: without categorical features (ids, not quantities) and events
    (feature_catalogue.NOT_MODEL_INPUTS)."""
    return {k: v for k, v in vector.items() if k not in NOT_MODEL_INPUTS}

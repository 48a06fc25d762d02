"""A model checkpoint is untrusted input: it comes from the model-state topic and the model_state
table, which others can write to. A crafted one must never run code or allocate what it declares,
and must fail with one CheckpointError line; the worker then relearns the job from scratch.

Regression: river's HalfSpaceTrees used to be restored with pickle.loads, so a crafted
model_state row ran a command as the worker's user (root on a node)."""
from __future__ import annotations

import base64
import io
import json
import os
import pickle
import resource
import zipfile

import numpy as np
import pytest

import fleetscope.streams.model.checkpoint as checkpoint
from fleetscope.config import Config
from fleetscope.streams.model import JobModel, ModelConfig
from fleetscope.streams.model.checkpoint import MAGIC
from fleetscope.streams.scoring import Scorer
from support.synthetic import SyntheticJob

ALL = ModelConfig(detectors=("gmm", "peer", "hst", "mahalanobis"))


class RunsCommand:
    """Unpickling this runs a shell command (what an attacker would put in a checkpoint)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def trained() -> bytes:
    job = SyntheticJob(n_ranks=4, seed=3)
    model = JobModel(ALL)
    for w in range(40):
        model.process_window(w * 10**9, job.window(None))
    return model.to_bytes()


def entries(blob: bytes) -> dict[str, bytes]:
    z = zipfile.ZipFile(io.BytesIO(blob[len(MAGIC):]))
    return {i.filename: z.read(i) for i in z.infolist()}


def pack(parts: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    buf.write(MAGIC)
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in parts.items():
            z.writestr(name, data)
    return buf.getvalue()


def npy(a: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=allow_pickle)
    return buf.getvalue()


def meta_of(parts: dict[str, bytes]) -> dict:
    return json.loads(np.load(io.BytesIO(parts["meta.npy"])).tobytes())


def with_meta(parts: dict[str, bytes], meta: dict) -> dict[str, bytes]:
    return {**parts, "meta.npy": npy(np.frombuffer(json.dumps(meta).encode(), np.uint8))}


def refused(blob: bytes, match: str) -> str:
    """from_bytes must raise CheckpointError, one line, matching ``match``."""
    with pytest.raises(ValueError) as err:
        JobModel.from_bytes(blob)
    assert type(err.value).__name__ == "CheckpointError", repr(err.value)
    text = str(err.value)
    assert "\n" not in text and match in text, text
    return text


@pytest.mark.parametrize("as_old_format", [False, True], ids=["current-format", "format-1-as-river-wrote-it"])
def test_a_pickle_payload_in_a_checkpoint_is_never_run(trained, tmp_path, as_old_format):
    marker = tmp_path / "ran"
    parts = entries(trained)
    parts["hst/river_pickle.npy"] = npy(np.frombuffer(pickle.dumps(RunsCommand(marker)), np.uint8))
    if as_old_format:
        parts = with_meta(parts, {**meta_of(parts), "format": 1})
    try:
        refused(pack(parts), "format 1" if as_old_format else "hst/river_pickle")
    finally:
        assert not marker.exists(), "the checkpoint's pickle ran a command"


def test_an_object_array_is_refused_by_its_dtype(trained, tmp_path):
    marker = tmp_path / "ran"
    parts = entries(trained)
    parts["det_gmm/s0.npy"] = npy(np.array([RunsCommand(marker)], dtype=object), allow_pickle=True)
    refused(pack(parts), "det_gmm/s0: dtype '|O'")
    assert not marker.exists()


def test_wrong_sizes_are_refused_before_the_model_uses_them(trained):
    parts = entries(trained)
    s1 = np.load(io.BytesIO(parts["det_gmm/s1.npy"]))
    bad = {**parts, "det_gmm/s1.npy": npy(np.zeros((s1.shape[0], s1.shape[1] + 1)))}
    refused(pack(bad), "det_gmm/s1: shape")
    bad = {**parts, "det_hst/feature.npy": npy(np.full((10, 255), 10_000, np.int64))}
    refused(pack(bad), "split features must lie in")
    bad = {**parts, "thr_gmm/peaks.npy": npy(np.zeros(7))}
    refused(pack(bad), "thr_gmm/peaks: shape")
    header_says_more = parts["scaler/count.npy"][:-8]          # one float short of its declared shape
    refused(pack({**parts, "scaler/count.npy": header_says_more}), "scaler/count")


def test_huge_declared_dimensions_allocate_nothing(trained):
    parts = entries(trained)
    small = npy(np.zeros(2))
    header = small[:-16].replace(b"(2,)", b"(2147483647, 2147483647)")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused(pack({**parts, "det_gmm/s0.npy": header + b"\0" * 16}), "det_gmm/s0")
    long_vector = small[:-16].replace(b"(2,)", b"(10000000,)")       # 80 MB declared, 16 bytes held
    refused(pack({**parts, "det_gmm/s0.npy": long_vector + b"\0" * 16}), "needs 80000000 bytes")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024   # KiB
    meta = meta_of(parts)
    for field, value in (("max_features", 10**9), ("hst_height", 40), ("hst_trees", 10**6)):
        refused(pack(with_meta(parts, {**meta, "config": {**meta["config"], field: value}})), field)
    names = {**meta["model"]["index"], "names": [f"f{i}" for i in range(5000)]}
    refused(pack(with_meta(parts, {**meta, "model": {**meta["model"], "index": names}})), "index names")


def test_truncated_corrupt_and_future_checkpoints_say_what_is_wrong(trained):
    refused(trained[: len(trained) // 2], "unreadable")
    refused(b"garbage" + trained, "bad magic")
    parts = entries(trained)
    refused(pack(with_meta(parts, {**meta_of(parts), "format": 99})), "format 99")
    refused(pack({**parts, "meta.npy": npy(np.frombuffer(b"[" * 100_000, np.uint8))}), "meta is not JSON")
    refused(pack(with_meta(parts, {**meta_of(parts), "config": {"detectors": ["gmm"], "evil": 1}})),
            "unknown fields ['evil']")


def test_random_corruption_gives_a_model_or_a_checkpoint_error_never_another_exception(trained):
    rng = np.random.default_rng(0)
    outcomes = {"loaded": 0, "refused": 0}
    for it in range(1000):
        blob = bytearray(trained)
        for i in rng.integers(0, len(blob), size=rng.integers(1, 4)):
            blob[i] = int(rng.integers(256))
        if it % 2:      # the zip directory and the meta JSON lie at the end
            blob[int(rng.integers(len(blob) - 3000, len(blob)))] = int(rng.integers(32, 127))
        try:
            JobModel.from_bytes(bytes(blob))
            outcomes["loaded"] += 1
        except checkpoint.CheckpointError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == 1000


def test_the_worker_relearns_a_job_whose_checkpoint_is_refused(store, tmp_path, trained):
    """The real Scorer on a real chDB store: the crafted model_state row is refused (and its
    payload never runs), the job gets a fresh model, and the next checkpoint replaces the row."""
    marker = tmp_path / "ran"
    parts = entries(trained)
    parts["hst/river_pickle.npy"] = npy(np.frombuffer(pickle.dumps(RunsCommand(marker)), np.uint8))
    crafted = pack(with_meta(parts, {**meta_of(parts), "format": 1}))
    store.insert("model_state", {"tenant": ["acme"], "job": ["train"], "saved_at": np.array([10**18], np.int64),
                                 "last_window": np.array([10**18], np.int64),
                                 "state": [base64.b64encode(crafted).decode()]})
    cfg = Config(data_dir=tmp_path, warmup_windows=5, model_checkpoint_s=0)
    scorer = Scorer(cfg, store)
    model = scorer.model("acme", "train")
    assert not marker.exists()
    assert model.windows == 0 and scorer.stats.restored_models == 0 and scorer.stats.models == 1
    job = SyntheticJob(n_ranks=3, seed=1)
    model.process_window(10**18 + 10**9, job.window(None))
    scorer.checkpoint(force=True)
    again = Scorer(cfg, store).model("acme", "train")
    assert again.windows == 1                        # the fresh model's checkpoint is the one restored now


def test_a_crafted_checkpoint_on_the_model_state_topic_is_refused_and_the_job_relearns(broker, store, tmp_path,
                                                                                        trained):
    """The worker's own path: states come from <prefix>.model-state (anyone with write access to the topic can
    publish one), through the real ModelStateTopic reader on the embedded broker, into the real StreamProcessor
    that restores a job's model before scoring it. The payload never runs; the job starts a fresh model."""
    import uuid

    from confluent_kafka import Producer

    from fleetscope.kafka_settings import client_conf
    from fleetscope.streams.model_state import JobState
    from fleetscope.streams.processor import StreamProcessor
    from fleetscope.streams.state_sources import ModelStateTopic
    from fleetscope.topics import ensure_topics

    marker = tmp_path / "ran"
    parts = entries(trained)
    parts["hst/river_pickle.npy"] = npy(np.frombuffer(pickle.dumps(RunsCommand(marker)), np.uint8))
    crafted = pack(with_meta(parts, {**meta_of(parts), "format": 1}))
    cfg = Config(data_dir=tmp_path, topic_prefix=f"crafted{uuid.uuid4().hex[:6]}", warmup_windows=5)
    topic = cfg.topic("model-state")
    ensure_topics(broker.bootstrap, [topic], partitions=1)
    producer = Producer({"bootstrap.servers": broker.bootstrap})
    state = JobState("acme", "train", base64.b64encode(crafted).decode())
    producer.produce(topic, key=b"acme/train", value=state.encode())
    assert producer.flush(30) == 0
    reader = ModelStateTopic(client_conf(cfg, broker.bootstrap, **{"group.id": "crafted-test"}), topic)
    try:
        proc = StreamProcessor(cfg, store, states=reader)
        assert reader.latest("acme", "train").model_b64 is not None  # the crafted state is what the worker reads
        proc._ensure_model("acme", "train")  # what the flush does before scoring a job's windows
    finally:
        reader.close()
    assert not marker.exists()
    model = proc.scorer.models[("acme", "train")]
    assert model.windows == 0 and proc.scorer.stats.restored_models == 0 and proc.scorer.stats.models == 1

"""A worker reads <prefix>.model-state to its end once per change of its input partitions, not once per new job.

Real broker (the embedded Kafka-protocol broker), the real ModelStateTopic reader; the processor's part runs on
the real chDB store with a state source that records what it is asked (the reader itself is tested above it).
"""
import uuid

from confluent_kafka import Producer

from fleetscope.kafka_settings import client_conf
from fleetscope.config import Config
from fleetscope.topics import ensure_topics
from fleetscope.wire import encode
from fleetscope.streams.model_state import JobState
from fleetscope.streams.processor import MessageRef
from fleetscope.streams.state_sources import ModelStateTopic
from support.host_processor import SEC, T0, FakeClock, host_batch, make_processor

JOBS = 60


def publish(bootstrap: str, topic: str, states: list[JobState]) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for st in states:
        p.produce(topic, key=f"{st.tenant}/{st.job}".encode(), value=st.encode())
    assert p.flush(30) == 0


def test_many_new_jobs_cost_one_read_to_the_end_and_an_invalidation_reads_what_others_published(broker, tmp_path):
    cfg = Config(data_dir=tmp_path, topic_prefix=f"catchup{uuid.uuid4().hex[:6]}")
    topic = cfg.topic("model-state")
    ensure_topics(broker.bootstrap, [topic], partitions=4)
    publish(broker.bootstrap, topic, [JobState("acme", f"job{i}", last_window_ns=T0 + i) for i in range(JOBS)])
    reader = ModelStateTopic(client_conf(cfg, broker.bootstrap, **{"group.id": "catchup-test"}), topic)
    try:
        found = [reader.latest("acme", f"job{i}") for i in range(JOBS)]
        assert [st.last_window_ns for st in found] == [T0 + i for i in range(JOBS)]
        assert reader.latest("acme", "never-published") is None
        assert reader.catch_ups == 1  # was one read to the end (a watermark request per partition) per job

        # the previous owner of job0's partition publishes its last state before letting it go; this worker's
        # next input partition invalidates, and the next answer holds that state
        publish(broker.bootstrap, topic, [JobState("acme", "job0", last_window_ns=T0 + 10 * SEC)])
        assert reader.latest("acme", "job0").last_window_ns == T0  # nothing invalidated: no read
        reader.invalidate()
        assert reader.latest("acme", "job0").last_window_ns == T0 + 10 * SEC
        assert reader.latest("acme", "job1").last_window_ns == T0 + 1
        assert reader.catch_ups == 2
    finally:
        reader.close()


def test_a_stale_state_written_after_a_newer_one_does_not_undo_it(broker, tmp_path):
    """A producer's first attempt, timed out at the client, can be written after its resend: the topic then holds
    the job's older state last. The reader keeps the newer state (by event time, its model included) and every
    window mark at its larger value."""
    cfg = Config(data_dir=tmp_path, topic_prefix=f"stale{uuid.uuid4().hex[:6]}")
    topic = cfg.topic("model-state")
    ensure_topics(broker.bootstrap, [topic], partitions=1)
    newer = JobState("acme", "j", model_b64="bmV3ZXI=", saved_at_ns=T0 + 6 * SEC, last_window_ns=T0 + 5 * SEC,
                     marks={("h1", 0): T0 + 5 * SEC, ("h1", 1): T0 + 4 * SEC})
    stale = JobState("acme", "j", model_b64="b2xkZXI=", saved_at_ns=T0 + 3 * SEC, last_window_ns=T0 + 2 * SEC,
                     marks={("h1", 0): T0 + 2 * SEC, ("h1", 1): T0 + 2 * SEC, ("h2", 0): T0 + SEC})
    publish(broker.bootstrap, topic, [newer, stale])
    reader = ModelStateTopic(client_conf(cfg, broker.bootstrap, **{"group.id": "stale-test"}), topic)
    try:
        got = reader.latest("acme", "j")
    finally:
        reader.close()
    assert (got.last_window_ns, got.saved_at_ns, got.model_b64) == (T0 + 5 * SEC, T0 + 6 * SEC, "bmV3ZXI=")
    assert got.marks == {("h1", 0): T0 + 5 * SEC, ("h1", 1): T0 + 4 * SEC, ("h2", 0): T0 + SEC}


def test_folding_states_orders_them_by_event_time_then_save_time_and_keeps_each_marks_maximum():
    a = JobState("t", "j", "A", saved_at_ns=10, last_window_ns=100, marks={("h", 0): 100})
    b = JobState("t", "j", "B", saved_at_ns=5, last_window_ns=200, marks={("h", 0): 200, ("h", 1): 50})
    assert a.folded(b).model_b64 == b.folded(a).model_b64 == "B"  # a later window wins over a later clock
    assert a.folded(b).marks == b.folded(a).marks == {("h", 0): 200, ("h", 1): 50}
    c = JobState("t", "j", "C", saved_at_ns=11, last_window_ns=100)
    assert a.folded(c).model_b64 == c.folded(a).model_b64 == "C"  # same window: the later save
    same = JobState("t", "j", "D", saved_at_ns=10, last_window_ns=100)
    assert a.folded(same).model_b64 == "D"  # a full tie: the topic's order


class RecordingStates:
    def __init__(self):
        self.invalidations = 0

    def latest(self, tenant, job):
        return None

    def forget(self, tenant, job):
        pass

    def invalidate(self):
        self.invalidations += 1


def test_the_processor_invalidates_on_each_input_partition_it_does_not_hold_yet(store, tmp_path):
    proc = make_processor(store, FakeClock(), tmp_path)
    proc.states = states = RecordingStates()

    def feed(partition: int, offset: int) -> None:
        proc.handle(encode(host_batch(T0 + offset * SEC // 2, 0.2, 0.3)), None,
                    MessageRef("fleetscope.raw.host", partition, offset))

    feed(0, 0)
    feed(0, 1)
    assert states.invalidations == 1  # the first message of partition 0
    feed(1, 2)
    assert states.invalidations == 2  # partition 1 arrived
    proc.revoke([("fleetscope.raw.host", 0)])
    feed(1, 3)
    assert states.invalidations == 2
    feed(0, 4)
    assert states.invalidations == 3  # partition 0 is back after its revoke: its jobs' states are read again

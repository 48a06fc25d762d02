"""The Faust app: raw topics in, the StreamProcessor does the work.

Values are read as raw bytes and decoded by us, so a bad message goes to the
DLQ instead of crashing the agent (Faust's own decoding would raise). Events
are taken with `noack()`; the processor acknowledges a message only after its
rows and windows are stored, and Faust commits acknowledged offsets only.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

import faust
from faust.types import TP

from fleetscope.kafka_settings import KafkaSecurity
from fleetscope.topics import RAW_SOURCES
from fleetscope.streams import faust_transport
from fleetscope.streams.ack_order import PartitionAckOrder
from fleetscope.streams.flusher import BackgroundFlusher
from fleetscope.streams.processor import MessageRef, StreamProcessor

log = logging.getLogger(__name__)


def highwater(app: faust.App, msg) -> int | None:
    """The message's partition's end offset as the consumer last fetched it: the windows do not take a key
    for silent while the worker is behind on its partition (windows.py). None when not known (not fetched yet,
    or the partition left this worker meanwhile)."""
    try:
        end = app.consumer.highwater(TP(msg.topic, msg.partition))
    except Exception:  # noqa: BLE001 - advisory (aiokafka asserts the partition is still assigned): unknown,
        return None    # and counted as partition_end_unknown, never a reason to stop consuming
    return end if isinstance(end, int) else None


def create_app(cfg, bootstrap: str, processor: StreamProcessor) -> faust.App:
    app = faust.App(
        cfg.consumer_group,
        broker=f"{faust_transport.SCHEME}://{bootstrap}",
        value_serializer="raw", key_serializer="raw",
        web_enabled=False, store="memory://",
        topic_partitions=cfg.partitions,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=1.0,
        # Open windows hold their messages unacknowledged on purpose; at stop,
        # don't wait for them: they are replayed from the committed offset.
        stream_wait_empty=False,
        # A worker killed without leaving the group holds its partitions until
        # its session times out; keep that short so a restart resumes quickly.
        broker_session_timeout=6.0, broker_heartbeat_interval=1.0, broker_rebalance_timeout=10.0,
        datadir=str(cfg.data_dir / "faust"),
        # The same security as every other client. Topics are created before Faust starts, with our topology
        # (Faust cannot ask for the broker's default replication); no leader-only timers, so no leader topic.
        **KafkaSecurity.from_config(cfg).faust_settings(),
        topic_allow_declare=cfg.create_topics, topic_disable_leader=True,
    )
    raw = app.topic(*[cfg.raw_topic(s) for s in RAW_SOURCES], value_type=bytes, key_type=bytes,
                    value_serializer="raw", key_serializer="raw")

    flusher = BackgroundFlusher(processor)
    ack_order = processor.ack_order = PartitionAckOrder()  # else Faust commits past unacknowledged messages

    @app.agent(raw, name="fleetscope-raw")
    async def consume(stream):
        async for event in stream.noack().events():
            msg = event.message
            ref = MessageRef(msg.topic, msg.partition, msg.offset,
                             ack=ack_order.track(msg.topic, msg.partition, msg.offset, event.ack),
                             timestamp_ms=int((msg.timestamp or 0) * 1000), highwater=highwater(app, msg))
            processor.handle(event.value, event.headers, ref, key=msg.key)
            await flusher.maybe_flush()

    stop_requested = threading.Event()  # the worker signalled itself once; the timer goes on firing until Faust stops

    def stop_for_good() -> None:
        # the producer failed for good: stop as on SIGTERM (acknowledged offsets are committed, the rest is
        # replayed by the next owner); run_streams then exits non-zero
        if not stop_requested.is_set():
            stop_requested.set()
            os.kill(os.getpid(), signal.SIGTERM)

    @app.timer(interval=0.1)
    async def flush_idle():
        # closes windows of keys that went quiet, flushes a slow trickle, finishes the flush in flight
        if processor.fatal_error is not None:
            stop_for_good()
            return
        await flusher.maybe_flush()

    @app.on_partitions_revoked.connect
    async def hand_over(app, revoked, **kwargs):
        # Partitions leave this worker: their open windows go to the new owner, not out as partial windows
        # (see StreamProcessor.revoke). Let the flush in flight finish first: it reads the state revoked.
        processor.hold_flushes(True)
        try:
            while processor.flushes_in_flight:
                if not processor.backlogged():  # backlogged: a maybe_flush in its backpressure loop finishes it
                    await flusher.maybe_flush()
                await asyncio.sleep(0.01)
            processor.revoke(revoked)
            ack_order.forget(revoked)
        finally:
            processor.hold_flushes(False)

    return app


def run_worker(app: faust.App, loglevel: str = os.environ.get("FLEETSCOPE_FAUST_LOGLEVEL", "warn")) -> None:
    """Run until SIGINT/SIGTERM; Faust commits the acknowledged offsets on stop."""
    from faust.worker import Worker
    Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False).execute_from_commandline()

"""Runs the worker's flushes on a thread, so decoding and windowing go on meanwhile.

chDB releases the GIL while it inserts (measured: the event loop kept ~72% of
its speed during a large insert), so the insert and the next batches overlap
on two cores. One flush is in flight at a time, and flushes finish in order.
When buffered rows pile up past `backlog_rows` the consumer waits for the
flush in flight, and while the rows waiting for the store pass the
processor's `max_unstored_rows` (a store outage) it keeps waiting, so the
consumer stops fetching and memory stays bounded: that is the backpressure.
The agent and the timer both call maybe_flush; a lock keeps one at a time.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from fleetscope.streams.processor import FlushJob, StreamProcessor


class BackgroundFlusher:
    def __init__(self, processor: StreamProcessor, backlog_rows: int | None = None):
        self.processor = processor
        self.backlog_rows = backlog_rows or 4 * processor.flush_rows
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="fleetscope-flush")
        self._inflight: tuple[FlushJob, asyncio.Future] | None = None
        self._lock: asyncio.Lock | None = None

    async def maybe_flush(self) -> None:
        """Call after every message and on a timer."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            await self._step()
            while self.processor.backlogged():
                await asyncio.sleep(0.05)
                await self._step()

    async def _step(self) -> None:
        if self._inflight is not None:
            job, future = self._inflight
            if not future.done() and self.processor.raw_rows < self.backlog_rows:
                return
            ok = await future
            self._inflight = None
            self.processor.finish_flush(job, ok)
        if self.processor.due():
            job = self.processor.begin_flush()
            if job is not None:
                loop = asyncio.get_running_loop()
                self._inflight = (job, loop.run_in_executor(self._executor, self.processor.run_flush, job))

    def close(self) -> None:
        self._executor.shutdown(wait=True)

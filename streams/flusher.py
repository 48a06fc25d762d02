"""Runs the worker's flushes on a thread, so decoding and windowing go on meanwhile.

chDB releases the GIL while it inserts (measured: the event loop kept ~72% of
its speed during a large insert), so the insert and the next batches overlap
on two cores. One flush is in flight at a time, and flushes finish in order.
When buffered rows pile up past `backlog_rows` the consumer waits for the
flush in flight: that is the backpressure.
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

    async def maybe_flush(self) -> None:
        """Call after every message and on a timer."""
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

"""What reading jobs' states back costs a worker when many new jobs arrive at once.

A real embedded broker holds `<prefix>.model-state` (4 partitions, one state per
job). The real ModelStateTopic reader answers `latest()` for N jobs it was not
asked for before, in two ways alternated in one run:
- per_job: an invalidation before every answer, as the reader behaved before
  723546d (each new job read the topic to its end: one watermark request per
  partition, then the fetches);
- per_partition_change: one invalidation for the batch, as a worker now does
  when an input partition arrives.
Wall seconds per batch of N answers (the reader waits on the broker, not the
CPU) and the ratio of the two medians.

    python benchmarks/state_catch_up_bench.py [--jobs 126] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=126, help="new jobs answered per batch (126: the profiled start)")
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds of each way")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "state_catch_up.json"))
    args = p.parse_args(argv)

    from confluent_kafka import Producer

    from fleetscope.broker import EmbeddedBroker
    from fleetscope.config import Config
    from fleetscope.kafka_settings import client_conf
    from fleetscope.topics import ensure_topics
    from fleetscope.streams.model_state import JobState
    from fleetscope.streams.state_sources import ModelStateTopic

    broker = EmbeddedBroker().start()
    try:
        cfg = Config(topic_prefix=f"statebench{uuid.uuid4().hex[:6]}")
        topic = cfg.topic("model-state")
        ensure_topics(broker.bootstrap, [topic], partitions=args.partitions)
        producer = Producer({"bootstrap.servers": broker.bootstrap})
        for i in range(args.jobs):
            producer.produce(topic, key=f"acme/job{i}".encode(), value=JobState("acme", f"job{i}").encode())
        assert producer.flush(30) == 0
        times: dict[str, list[float]] = {"per_job": [], "per_partition_change": []}
        for r in range(args.rounds):
            for way in times:
                reader = ModelStateTopic(client_conf(cfg, broker.bootstrap, **{"group.id": f"bench-{r}-{way}"}),
                                         topic)
                try:
                    reader.latest("acme", "warm-up")  # the assignment and first read, outside the timing
                    reader.invalidate()
                    start = time.perf_counter()
                    for i in range(args.jobs):
                        if way == "per_job":
                            reader.invalidate()
                        assert reader.latest("acme", f"job{i}") is not None
                    times[way].append(time.perf_counter() - start)
                finally:
                    reader.close()
        med = {way: statistics.median(ts) for way, ts in times.items()}
        result = {
            "benchmark": "state_catch_up",
            "command": "python benchmarks/state_catch_up_bench.py " + " ".join(argv or sys.argv[1:]),
            "jobs": args.jobs, "partitions": args.partitions, "rounds": args.rounds,
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()], "nproc": os.cpu_count(),
            "seconds_per_batch": {way: [round(t, 4) for t in ts] for way, ts in times.items()},
            "median_s": {way: round(t, 4) for way, t in med.items()},
            "per_job_over_per_partition_change": round(med["per_job"] / med["per_partition_change"], 1),
        }
    finally:
        broker.stop()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

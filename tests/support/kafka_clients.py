"""How many librdkafka clients this test process holds: each client runs one thread named rdk:main, so a
client that was dropped but never freed (a reference cycle through its delivery callbacks) shows here."""
from __future__ import annotations

import glob

from support.processes import wait_until


def librdkafka_instances() -> int:
    names = []
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(comm) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("rdk:main")


def wait_for_clients_at_most(limit: int, timeout_s: float = 10.0) -> None:
    """librdkafka ends a freed client's threads asynchronously: wait (bounded) for the count to fall."""
    try:
        wait_until(lambda: librdkafka_instances() <= limit, timeout_s)
    except AssertionError:
        raise AssertionError(f"{librdkafka_instances() - limit} librdkafka clients left alive") from None

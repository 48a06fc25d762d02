"""A Python workload with known call counts, for the Python tracer tests.

Waits for a go-file (argv[1]) to appear, so the tracer can attach first;
then calls leaf() LEAF_CALLS times (each through middle(), which calls it
twice), runs gc.collect() GC_CALLS times, writes argv[1] + ".done" and
sleeps (argv[2] seconds, default 30) so the tracer can sample before exit.
With argv[2] == "loop" it repeats run() until killed; with "spin" it spins in
spin() until killed, never sleeping (a sampler finds it there, running or runnable).
"""
import gc
import os
import sys
import time

LEAF_CALLS = 2000
GC_CALLS = 5


def leaf(x):
    return x + 1


def middle(x):
    return leaf(leaf(x))


def run():
    total = 0
    for i in range(LEAF_CALLS // 2):
        total += middle(i)
    for _ in range(GC_CALLS):
        gc.collect()
    return total


def spin():
    total = 0
    while True:  # never sleeps or waits: on a loaded machine it waits for a CPU inside spin(), not elsewhere
        total = middle(total) % 1000


if __name__ == "__main__":
    go = sys.argv[1]
    while not os.path.exists(go):
        time.sleep(0.01)
    if sys.argv[2:3] == ["spin"]:  # until killed
        spin()
    if sys.argv[2:3] == ["loop"]:  # until killed
        while True:
            run()
            time.sleep(0.01)
    run()
    open(go + ".done", "w").close()
    time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 30)

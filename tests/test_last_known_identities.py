"""LastKnownIdentities: what the kernel tracer and the trace capture use to keep a gone process's rows (or
calls) under the identity it had. The resolver here is a dict, standing for the resolver's answer per pid;
the real resolver over /proc is tested in test_identity and through both users' own tests."""
from __future__ import annotations

from types import SimpleNamespace

from fleetscope.producers.tracers.rows import LastKnownIdentities, RowIdentity
from fleetscope.schema import NO_GPU, NO_RANK, NODE_TENANT


class DictResolver:
    def __init__(self):
        self.answers: dict[int, SimpleNamespace] = {}

    def resolve(self, pid):
        return self.answers.get(pid)


def test_a_gone_process_keeps_its_last_identity_until_forgotten_or_expired():
    resolver = DictResolver()
    ids = LastKnownIdentities(resolver, "node-a")
    node = RowIdentity(NODE_TENANT, "node-a", NO_RANK, NO_GPU)
    assert ids.node == node and ids.resolve(7) == node and ids.known() == []  # never known: the node's
    resolver.answers[7] = SimpleNamespace(tenant="acme", job="train", rank=3, gpu=1)
    resolver.answers[8] = SimpleNamespace(tenant="acme", job="train", rank=4, gpu=2)
    rank3 = ids.resolve(7, now_ns=100)
    assert rank3 == RowIdentity("acme", "train", 3, 1) and ids.resolve(8, now_ns=200).rank == 4
    del resolver.answers[7], resolver.answers[8]  # both exit: the resolver no longer knows them
    assert ids.resolve(7, now_ns=300) == rank3  # a miss does not refresh when it was last resolved
    assert sorted(i.rank for i in ids.known()) == [3, 4]
    ids.expire(before_ns=150)
    assert ids.resolve(7) == node and [i.rank for i in ids.known()] == [4]
    assert ids.forget(8).rank == 4 and ids.forget(8) is None and ids.resolve(8) == node


def test_a_resolver_that_raises_is_the_node_s_identity_and_leaves_the_last_one_in_place():
    class Flaky(DictResolver):
        fail = False

        def resolve(self, pid):
            if self.fail:
                raise ProcessLookupError(pid)  # the process exited mid-resolution
            return super().resolve(pid)

    resolver = Flaky()
    resolver.answers[5] = SimpleNamespace(tenant="beta", job="eval", rank=0, gpu=None)
    ids = LastKnownIdentities(resolver, "node-b")
    assert ids.resolve(5) == RowIdentity("beta", "eval", 0, NO_GPU)
    resolver.fail = True
    assert ids.resolve(5) == RowIdentity("beta", "eval", 0, NO_GPU)

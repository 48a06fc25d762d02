"""The message walk (ipc_frames.read_body) remembers dictionary messages and message
headers by their bytes, because producers resend the same dictionaries with every batch.
These tests prove the memo changes nothing the decoder decides: on valid messages and on
thousands of seeded mutants, the walk with its memo warm gives exactly the result, or the
exact error text, of the walk with the memo turned off; and a dictionary remembered from
a good message does not let a bomb through in a later one."""
from __future__ import annotations

import random
import struct

import pytest

from fleetscope import arrow_wire, ipc_frames
from fleetscope.eval.wire_mutations import mutant, sample_batch
from fleetscope.wire import WireError, decode, encode
from support.wire_messages import metric_batch, reseal


def walk(data: bytes) -> str:
    """The walk's verdict as text: the body it found, or its error (only WireError may leave)."""
    view = memoryview(data)
    try:
        end = arrow_wire.schema_end(view)
        return repr(ipc_frames.read_body(view, end, arrow_wire.MAX_DECODED_BYTES))
    except WireError as exc:
        return f"WireError: {exc}"


@pytest.fixture
def no_memo(monkeypatch):
    """Switch the memo off: every message is walked in place, as before it existed."""
    def off():
        monkeypatch.setattr(ipc_frames, "CACHED_DICTIONARY_MESSAGE_BYTES", -1)
        monkeypatch.setattr(ipc_frames, "CACHED_HEADER_BYTES", -1)
    return off


def messages(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    valid = [encode(sample_batch(rng)) for _ in range(8)]
    return valid + [mutant(rng, rng.choice(valid))[1] for _ in range(count)]


def test_the_walk_decides_the_same_with_and_without_its_memo(no_memo):
    inputs = messages(seed=14, count=2500)
    warm = [walk(data) for data in inputs]  # fills the memo as it goes
    again = [walk(data) for data in inputs]  # now answered from it where it can
    no_memo()
    cold = [walk(data) for data in inputs]
    assert ipc_frames._remembered_dictionary_bytes.cache_info().hits > 0  # the memo was really used
    assert sum(v.startswith("Body(") for v in cold) >= 8 and sum(v.startswith("WireError") for v in cold) > 100
    mismatches = [(i, c, w) for i, (c, w, a) in enumerate(zip(cold, warm, again)) if not c == w == a]
    assert not mismatches, mismatches[:5]


def dictionary_buffer_prefix(data: bytes) -> int:
    """Where the first dictionary message's largest buffer declares its
    uncompressed size: the int64 before its zstd frame."""
    view = memoryview(data)
    pos = arrow_wire.schema_end(view)
    kind, start, length, header, body = ipc_frames._message(view, pos)
    assert kind == ipc_frames.DICTIONARY_BATCH
    buf = view[start:start + length]
    batch = ipc_frames._ref(buf, ipc_frames._fields(buf, header, 2)[1])
    first = ipc_frames._ref(buf, ipc_frames._fields(buf, batch, 4)[2])
    count = struct.unpack_from("<I", buf, first)[0]
    pairs = struct.unpack_from(f"<{2 * count}q", buf, first + 4)
    offset, _ = max(zip(pairs[0::2], pairs[1::2]), key=lambda pair: pair[1])
    return start + length + offset


def test_a_remembered_dictionary_does_not_let_a_bomb_through_in_the_next_message():
    good = encode(metric_batch(50))
    decode(good)
    decode(good)  # its dictionaries are now remembered
    assert ipc_frames._remembered_dictionary_bytes.cache_info().currsize > 0
    at = dictionary_buffer_prefix(good)
    claimed = arrow_wire.MAX_DECODED_BYTES + 1
    bad = reseal(good[:at] + struct.pack("<q", claimed) + good[at + 8:])
    with pytest.raises(WireError, match=rf"decompression bomb: buffer \d declares {claimed} bytes uncompressed"):
        decode(bad)
    with pytest.raises(WireError, match=rf"decompression bomb: buffer \d declares {claimed} bytes uncompressed"):
        decode(bad)  # refused again: a refused dictionary is never remembered
    assert decode(good).count == 50

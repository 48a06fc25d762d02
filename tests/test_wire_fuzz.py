"""Fuzzing the raw-message decoder for a fixed budget, and replaying every input
that ever broke it (tests/fuzz_corpus/).

The contract checked (fleetscope.eval.wire_mutations.check): whatever the bytes,
decode raises only WireError, with a precise one-line reason rather than the
safety net's generic one; whatever it accepts has columns of equal length and
encodes again. The mutator is seeded, so a run is reproducible;
FLEETSCOPE_FUZZ_SEED and FLEETSCOPE_FUZZ_INPUTS explore further. The long run
(>= 10^6 inputs) is benchmarks/fuzz_bench.py.
"""
import hashlib
import os
from pathlib import Path

import pytest

from fleetscope.eval.wire_mutations import STRATEGIES, check, fuzz

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
CORPUS_FILES = sorted(CORPUS.glob("*.bin"))


def test_the_corpus_is_kept():
    assert CORPUS_FILES, "tests/fuzz_corpus/ holds the inputs that once broke the decoder"


@pytest.mark.parametrize("path", CORPUS_FILES, ids=[p.stem for p in CORPUS_FILES])
def test_corpus_input_is_rejected_with_a_precise_wire_error(path):
    assert check(path.read_bytes()) is None


def test_decoder_keeps_its_contract_under_a_fixed_fuzz_budget():
    seed = int(os.environ.get("FLEETSCOPE_FUZZ_SEED", "20240614"))
    inputs = int(os.environ.get("FLEETSCOPE_FUZZ_INPUTS", "1500"))
    saved = []

    def keep(strategy, data, problem):
        path = CORPUS / f"{hashlib.sha1(data).hexdigest()[:16]}.bin"
        path.write_bytes(data)
        saved.append(f"{strategy}: {problem} -> {path.name}")

    result = fuzz(inputs, seed, on_failure=keep)
    assert not saved, "decoder broke its contract (inputs saved to tests/fuzz_corpus/, commit them):\n" + "\n".join(saved)
    # the budget reached every strategy, and the mutants were mostly rejected, not silently accepted
    by = result["by_strategy"]
    assert all(sum(by[s].values()) > 0 for s in STRATEGIES)
    assert by["truncate"]["accepted"] == 0 and by["random_bytes"]["accepted"] == 0

"""Block names a client cannot forge (issue 24, section 1).

``tests/fixtures/block_hash_collision.json`` holds blocks built once, offline, by
``scripts/find_block_hash_collision.py``: a victim's first block ``A`` and second ``B``, and two
attacker blocks ``X, G`` such that the old key of ``G`` after ``X`` hashed like the old key of
``A`` at the start of a prompt, so that the attacker's ``B`` after ``X + G`` took the name of the
victim's ``B`` after ``A``. Its K/V, computed after other tokens, was then served to the victim.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import infer_lab as il
from infer_lab.cache.block_pool import NONE_KEY, block_key
from infer_lab.engine import LLMEngine, SamplingParams

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "block_hash_collision.json")
                     .read_text())
A, B, X, G = (FIXTURE[k] for k in ("A", "B", "X", "G"))


def old_key(parent: tuple | None, tokens: list[int]) -> tuple:
    """The key before issue 24: (hash of the parent key, the tokens)."""
    return (0 if parent is None else hash(parent), tuple(tokens))


def test_the_fixture_is_a_collision_of_the_old_keys():
    """Different blocks, one name: what let the attacker's B pass for the victim's."""
    assert G != A and X + G != A
    assert hash(old_key(old_key(None, X), G)) == hash(old_key(None, A))
    assert old_key(old_key(old_key(None, X), G), B) == old_key(old_key(None, A), B)


def test_the_new_keys_tell_the_blocks_apart():
    assert block_key(block_key(None, X), G) != block_key(None, A)
    assert block_key(block_key(block_key(None, X), G), B) != block_key(block_key(None, A), B)


def test_the_key_is_sha256_of_the_parent_and_the_tokens_little_endian():
    tokens = [0, 1, 255, 256, 65535, 65536, 2**32 - 1]
    want = hashlib.sha256(NONE_KEY + b"".join(t.to_bytes(4, "little") for t in tokens))
    assert block_key(None, tokens) == want.digest()
    child = hashlib.sha256(want.digest() + struct.pack("<2I", 7, 9)).digest()
    assert block_key(want.digest(), [7, 9]) == child
    assert len(child) == 32


@pytest.mark.parametrize(("one", "two"), [
    ([1, 0], [256]),  # fixed width: no two token lists share their bytes
    ([0], [0, 0]),
    ([2, 1], [1, 2]),
])
def test_different_tokens_different_keys(one, two):
    assert block_key(None, one) != block_key(None, two)
    assert block_key(block_key(None, one), [5]) != block_key(block_key(None, two), [5])


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5]])
def test_token_ids_outside_uint32_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        block_key(None, bad)


def test_keys_are_the_same_in_every_process():
    """A second KV tier or another engine can look a block up by its name."""
    code = ("import json, sys; from infer_lab.cache.block_pool import block_key; "
            "k = block_key(None, [1, 2, 3]); print(block_key(k, [4, 5]).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert other == block_key(block_key(None, [1, 2, 3]), [4, 5]).hex() + "\n"


def test_the_attackers_blocks_do_not_change_the_victims_answer():
    """End to end on the bundled model: the attacker sends A, then X + G + B; the victim's
    greedy answer to A + B + ... is that of naive decoding (with the old keys, the victim's
    second block was the attacker's, computed after X + G, and the answer changed)."""
    model, tok = il.load(device="cpu")
    engine = LLMEngine(model, tok, il.EngineConfig(num_kv_blocks=64, block_size=16))
    victim = A + B + FIXTURE["victim_tail"]
    names = iter(range(10))

    def greedy(ids: list[int], n: int) -> list[int]:
        engine.add_request(str(next(names)), ids,
                           SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        out = []
        while engine.has_unfinished_requests():
            out += [o for o in engine.step() if o.finished]
        return out[0].token_ids

    greedy(A + [1], 1)
    greedy(X + G + B + [1], 1)
    hits = engine.get_stats().prefix_cache_hits
    got = greedy(victim, 16)
    assert engine.get_stats().prefix_cache_hits - hits == 16  # A was shared (genuinely), B not
    want = il.generate_naive(model, tok, victim, max_tokens=16, ignore_eos=True).token_ids
    assert got == want

"""Find two prompts whose KV blocks Python's ``hash()`` cannot tell apart (issue 24), once.

Until issue 24 the prefix cache named a full block ``(hash(parent_key), tuple(tokens))``. For a
tuple of small ints ``hash()`` is unseeded (``PYTHONHASHSEED`` does not touch ints or tuples) and
every step of it is invertible, so an attacker who knows a victim's first block ``A`` (a shared
system prompt) can find two blocks ``X, G`` such that the key of ``G`` after ``X`` hashes like the
key of ``A`` at the start of a prompt. Then the block after ``X + G`` and the block after ``A``
get the *same* key: whatever the attacker sends after ``X + G`` is served, cached K/V and all, to
every victim whose prompt continues ``A`` with the same tokens.

The search is a birthday search, not a second preimage: for any ``X`` the hash that ``G`` needs is
fixed (one step of the tuple hash, inverted), so it is enough that one of the values ``X`` asks
for equals one of the values ``G`` hashes to: about 2**32 evaluations of 64-bit values, which
parallel collision search with distinguished points (van Oorschot and Wiener) does in numpy with
little memory. Ten tokens of each attacker block are the attacker's own text; six are free (ids
below 2048, 66 bits).

    python scripts/find_block_hash_collision.py            # ~10-30 min on one core, once
    python scripts/find_block_hash_collision.py --bits 36  # the same machinery on a 36-bit
                                                           # truncation: seconds, for a check

writes ``tests/fixtures/block_hash_collision.json``, which ``tests/test_block_key.py`` reads (CI
never searches). Needs only numpy and the bundled tokenizer.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

M64 = (1 << 64) - 1
P1, P2, P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
P1_INV, P2_INV = pow(P1, -1, 1 << 64), pow(P2, -1, 1 << 64)
MERSENNE = (1 << 61) - 1  # ints hash modulo this prime
FREE, FREE_BITS = 6, 11  # six free tokens of 11 bits: 66 >= 63 bits of a walk's state
FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "block_hash_collision.json"

# The victim's prompt: its first block A (a system prompt every tenant shares) and the next, B.
VICTIM = ("And God said, Let there be light: and there was light. And God saw the light, that it "
          "was good: and God divided the light from the darkness. And God called the light Day")
ATTACKER_X = "Blessed are the meek: for they shall inherit"  # text of X's first 10 tokens
ATTACKER_G = "Thou shalt not steal. Thou shalt not bear false"  # text of G's first 10 tokens


# ------------------------------------------------------------------ CPython's hashes, in Python
def rotl(x: int, r: int = 31) -> int:
    return ((x << r) | (x >> (64 - r))) & M64


def rotr(x: int, r: int = 31) -> int:
    return ((x >> r) | (x << (64 - r))) & M64


def step(acc: int, lane: int) -> int:
    """One lane of CPython's tuple hash (xxHash-based, Objects/tupleobject.c)."""
    return rotl((acc + lane * P2) & M64, 31) * P1 & M64


def finish(acc: int, n: int) -> int:
    acc = (acc + (n ^ (P5 ^ 3527539))) & M64
    return 1546275796 if acc == M64 else acc


def int_lane(value: int) -> int:
    """``hash(value)`` of a 64-bit signed int as an unsigned lane (Python/pyhash.c)."""
    magnitude = abs(value) % MERSENNE
    h = magnitude if value >= 0 else -magnitude
    return (-2 if h == -1 else h) & M64


def signed(u: int) -> int:
    return u - (1 << 64) if u >> 63 else u


def tuple_hash(lanes: list[int]) -> int:
    acc = P5
    for lane in lanes:
        acc = step(acc, lane)
    return finish(acc, len(lanes))


def old_key_hash(parent_hash: int, tokens: list[int]) -> int:
    """``hash((parent_hash, tuple(tokens)))``: the old block key's hash (signed, like hash())."""
    return signed(tuple_hash([int_lane(parent_hash), tuple_hash(tokens)]))


# ------------------------------------------------------------------ the walk, vectorised
class Walk:
    """f(v): v's low bit picks the side; its other 63 bits are the six free tokens.

    side 0 (G): the hash of G's tokens; side 1 (X): the hash G's tokens would need after X. A
    collision f(v) == f(w) with v on side 1 and w on side 0 is the attack."""

    def __init__(self, x_prefix: list[int], g_prefix: list[int], target: int, bits: int) -> None:
        self.acc_x, self.acc_g = P5, P5
        for t in x_prefix:
            self.acc_x = step(self.acc_x, t)
        for t in g_prefix:
            self.acc_g = step(self.acc_g, t)
        n = len(x_prefix) + FREE
        self.tail = n ^ (P5 ^ 3527539)
        self.after_zero = step(P5, 0)  # the first lane of X's key: its parent, 0
        two = 2 ^ (P5 ^ 3527539)
        self.need = rotr(((target - two) & M64) * P1_INV & M64)  # acc1 + lane1 * P2 must be this
        self.two = two
        self.mask = (1 << bits) - 1

    def scalar(self, v: int) -> int:
        free = [(v >> 1 >> (FREE_BITS * k)) & ((1 << FREE_BITS) - 1) for k in range(FREE)]
        if v & 1:
            acc = self.acc_x
            for t in free:
                acc = step(acc, t)
            hx = signed(finish(step(self.after_zero, (acc + self.tail) & M64), 2))
            lane0 = int_lane(hx)
            out = (self.need - step(P5, lane0)) * P2_INV & M64
        else:
            acc = self.acc_g
            for t in free:
                acc = step(acc, t)
            out = (acc + self.tail) & M64
        return out & self.mask

    def vector(self, v: np.ndarray) -> np.ndarray:
        """:meth:`scalar` on an array, in place where numpy allows (the arrays stay in cache)."""
        u64 = np.uint64
        ax, ag = np.full_like(v, self.acc_x), np.full_like(v, self.acc_g)
        t, tmp = np.empty_like(v), np.empty_like(v)
        for k in range(FREE):
            np.right_shift(v, u64(1 + FREE_BITS * k), out=t)
            np.bitwise_and(t, u64((1 << FREE_BITS) - 1), out=t)
            _vstep(ax, t, tmp)
            _vstep(ag, t, tmp)
        ax += u64(self.tail)  # hash(tuple(X))
        hx = np.full_like(v, self.after_zero)
        _vstep(hx, ax, tmp)
        hx += u64(self.two)  # hash((0, tuple(X)))
        lane0 = _vint_lane(hx)
        acc1 = np.full_like(v, P5)
        _vstep(acc1, lane0, tmp)
        out_x = (u64(self.need) - acc1) * u64(P2_INV)
        ag += u64(self.tail)  # hash(tuple(G))
        out = np.where((v & u64(1)).astype(bool), out_x, ag)
        out &= u64(self.mask)
        return out


def _vstep(acc: np.ndarray, lane: np.ndarray, tmp: np.ndarray) -> None:
    """acc = rotl(acc + lane * P2, 31) * P1, in place."""
    np.multiply(lane, np.uint64(P2), out=tmp)
    acc += tmp
    np.right_shift(acc, np.uint64(33), out=tmp)
    np.left_shift(acc, np.uint64(31), out=acc)
    acc |= tmp
    acc *= np.uint64(P1)


def _vint_lane(h: np.ndarray) -> np.ndarray:
    """int_lane of signed values held as uint64: the magnitude modulo 2**61 - 1 by folding the
    high bits (2**61 == 1 mod the prime), the sign put back; hash -1 is -2."""
    negative = (h >> np.uint64(63)).astype(bool)
    magnitude = np.where(negative, np.uint64(0) - h, h)
    folded = (magnitude & np.uint64(MERSENNE)) + (magnitude >> np.uint64(61))
    folded = np.where(folded >= np.uint64(MERSENNE), folded - np.uint64(MERSENNE), folded)
    lane = np.where(negative, np.uint64(0) - folded, folded)
    return np.where(lane == np.uint64(M64), np.uint64(M64 - 1), lane)


# ------------------------------------------------------------------ distinguished points
def search(walk: Walk, walks: int, dp_bits: int, seed: int, log_every: float = 30.0):
    """Parallel collision search; returns (v, w) with f(v) == f(w), v on side 1, w on side 0."""
    rng = np.random.default_rng(seed)
    dp_mask = np.uint64((1 << dp_bits) - 1)
    start = rng.integers(0, 2**63, walks, dtype=np.uint64) << np.uint64(1) | rng.integers(
        0, 2, walks, dtype=np.uint64)
    cur, length = start.copy(), np.zeros(walks, dtype=np.int64)
    seen: dict[int, tuple[int, int]] = {}
    evals, t0, last = 0, time.monotonic(), time.monotonic()
    cap = 20 << dp_bits
    while True:
        cur = walk.vector(cur)
        length += 1
        evals += walks
        hit = np.flatnonzero(((cur & dp_mask) == 0) | (length > cap))
        for i in hit:
            point, s, n = int(cur[i]), int(start[i]), int(length[i])
            if n <= cap:
                if point in seen and seen[point][0] != s:
                    pair = _merge(walk, (s, n), seen[point])
                    if pair is not None:
                        v, w = pair
                        print(f"collision after {evals:.3g} evaluations: sides {v & 1}, {w & 1}")
                        if (v & 1) != (w & 1):
                            return (v, w) if v & 1 else (w, v), evals, time.monotonic() - t0
                seen[point] = (s, n)
            fresh = int(rng.integers(0, 2**64, dtype=np.uint64))
            start[i] = cur[i] = fresh
            length[i] = 0
        if time.monotonic() - last > log_every:
            last = time.monotonic()
            rate = evals / (last - t0)
            print(f"{evals:.3g} evaluations, {rate:.3g}/s, {len(seen)} distinguished points",
                  flush=True)


def _merge(walk: Walk, a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """Walk two chains that end in the same point to where they meet: the colliding inputs."""
    (x, n), (y, m) = a, b
    while n > m:
        x, n = walk.scalar(x), n - 1
    while m > n:
        y, m = walk.scalar(y), m - 1
    if x == y:
        return None  # one start lies on the other's chain: no collision
    while True:
        fx, fy = walk.scalar(x), walk.scalar(y)
        if fx == fy:
            return x, y
        x, y = fx, fy


def free_tokens(v: int) -> list[int]:
    return [(v >> 1 >> (FREE_BITS * k)) & ((1 << FREE_BITS) - 1) for k in range(FREE)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", type=int, default=64, help="truncate to check the machinery")
    parser.add_argument("--walks", type=int, default=1 << 18)
    parser.add_argument("--dp-bits", type=int, default=14)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from infer_lab.model.loader import resolve_model_path
    from infer_lab.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_path(None))
    victim = tok.encode(VICTIM, add_special_tokens=False)
    a, b = victim[:16], victim[16:32]
    x_prefix = tok.encode(ATTACKER_X, add_special_tokens=False)[:16 - FREE]
    g_prefix = tok.encode(ATTACKER_G, add_special_tokens=False)[:16 - FREE]
    assert len(b) == 16 and len(x_prefix) == len(g_prefix) == 16 - FREE
    target = old_key_hash(0, a) & M64
    walk = Walk(x_prefix, g_prefix, target, args.bits)
    (v, w), evals, seconds = search(walk, args.walks, args.dp_bits, args.seed)
    x, g = x_prefix + free_tokens(v), g_prefix + free_tokens(w)
    if args.bits < 64:
        print("truncated run: the machinery works; no fixture written")
        return
    hx = old_key_hash(0, x)
    assert hash((0, tuple(a))) == old_key_hash(0, a)  # the Python model of hash() is exact
    assert hash((hash((0, tuple(x))), tuple(g))) == hash((0, tuple(a))), "not a collision"
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps({
        "what": "old block keys: hash((hash(key(X)), tuple(G))) == hash((0, tuple(A)))",
        "model": "tiny-kjv (bundled)", "block_size": 16,
        "victim_text": VICTIM, "A": a, "B": b, "victim_tail": victim[32:],
        "X": x, "G": g, "hash_key_A": hash((0, tuple(a))), "hash_key_X": hx,
        "evaluations": evals, "search_seconds": round(seconds, 1),
        "command": "python scripts/find_block_hash_collision.py",
    }, indent=1) + "\n")
    print(f"wrote {FIXTURE} ({evals:.3g} evaluations, {seconds:.0f} s)")


if __name__ == "__main__":
    main()

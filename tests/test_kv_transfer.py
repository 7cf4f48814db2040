"""Chapter 13's KV transfer: blocks pulled over TCP by request and block id into another
engine's pool (the full blocks and the partial last one), the receiver computing only what is
missing; and what the endpoint refuses."""

from __future__ import annotations

import random
import socket
import time

import pytest

from infer_lab.engine import LLMEngine, SamplingParams
from infer_lab.engine.kv_connector import engine_namespace, inject_blocks, stage_partial_block
from infer_lab.engine.kv_partial import PartialBlock
from infer_lab.engine.kv_transfer import (
    KVTransferError,
    KVTransferServer,
    pull_blocks,
    release_blocks,
)
from tests.engine_fixtures import assert_no_leak, tiny_model

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return tiny_model(tmp_path_factory)


def generate(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                          ignore_eos=True))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished and o.request_id == request_id:
                out = o.outputs[0].token_ids
    assert out is not None
    return out


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


@pytest.fixture()
def pair(loaded):
    """A sender (prefill) engine with its endpoint, and a receiver with a smaller pool."""
    model, tok = loaded
    sender = LLMEngine(model, tok, num_kv_blocks=24, block_size=16)
    receiver = LLMEngine(model, tok, num_kv_blocks=17, block_size=16)
    server = KVTransferServer(sender, TOKEN, pin_timeout_s=60)
    yield sender, receiver, server
    server.close()


@pytest.mark.parametrize("length", [15, 16, 17, 40, 100])
def test_pulled_blocks_give_the_same_tokens_and_only_the_last_token_is_computed(loaded, pair,
                                                                               length):
    sender, receiver, server = pair
    p = prompt(length, seed=length)
    reference = generate(LLMEngine(loaded[0], loaded[1], num_kv_blocks=24), "ref", p, 8)
    server.expect("req")
    generate(sender, "req", p, 1)  # the prefill (max_tokens=1): held as it finishes
    pinned = server.pinned("req")
    full, rest = divmod(length - 1, 16)  # every prompt token but the last has its K/V there
    assert len(pinned.keys) == full and pinned.tail == p[full * 16 : length - 1]
    assert len(pinned.block_ids) == full + (rest > 0)  # the partial last block too
    assert sender.kv.num_free_blocks == 24 - len(pinned.block_ids)
    received = pull_blocks(server.host, server.port, TOKEN, "req", pinned.block_ids,
                           engine_namespace(receiver))
    assert [k for k, _ in received.blocks] == pinned.keys
    assert (received.tail is not None) == (rest > 0)
    assert release_blocks(server.host, server.port, TOKEN, "req")
    server.poll()
    assert_no_leak(sender)  # released: the sender's pool is whole again
    # occupy some of the receiver's blocks first, so its block ids differ from the sender's
    taken = receiver.kv.pool.get_new_blocks(3)
    assert inject_blocks(receiver, p, received.blocks) == full
    if rest:
        assert stage_partial_block(receiver, "req", p, full, received.tail) == rest
    assert generate(receiver, "req", p, 8) == reference
    assert receiver.kv.prefix_hits == length - 1  # computed only the last prompt token
    assert receiver.kv.num_free_blocks == 17 - 3
    assert not receiver.kv.partial  # the partial block was written and forgotten
    receiver.kv.pool.free_blocks(taken)
    assert_no_leak(receiver)


def test_a_partial_block_is_taken_only_for_its_own_tokens_after_its_own_prefix(loaded, pair):
    """A partial block has no key: it is matched by its tokens, right after the full blocks
    its parent key names. Anything else is not taken, and the tokens stay right."""
    sender, receiver, server = pair
    p = prompt(40, seed=7)  # 2 full blocks and 7 tokens
    server.expect("r")
    generate(sender, "r", p, 1)
    got = pull_blocks(server.host, server.port, TOKEN, "r", server.pinned("r").block_ids,
                      engine_namespace(receiver))
    release_blocks(server.host, server.port, TOKEN, "r")
    server.poll()
    tail = got.tail
    assert tail is not None and tail.tokens == p[32:39] and tail.parent == got.blocks[-1][0]
    other = p[:35] + [(t % 380) + 3 for t in p[35:38]] + p[38:]  # differs inside the tail
    assert stage_partial_block(receiver, "x", other, 2, tail) == 0
    wrong_parent = PartialBlock(tail.tokens, got.blocks[0][0], tail.payload)
    assert stage_partial_block(receiver, "x", p, 2, wrong_parent) == 0
    assert stage_partial_block(receiver, "x", p, 1, tail) == 0  # not after block 2
    assert stage_partial_block(receiver, "x", p[:39], 2, tail) == 0  # would cover the last
    short = PartialBlock(tail.tokens, tail.parent, tail.payload[:-1])
    assert stage_partial_block(receiver, "x", p, 2, short) == 0
    assert not receiver.kv.partial
    # staged for one request, a request of other tokens under that id does not take it
    assert stage_partial_block(receiver, "y", p, 2, tail) == 7
    inject_blocks(receiver, p, got.blocks)
    reference = generate(LLMEngine(loaded[0], loaded[1], num_kv_blocks=24), "ref", other, 6)
    assert generate(receiver, "y", other, 6) == reference
    assert receiver.kv.prefix_hits == 32  # the full blocks the prompts share, not the tail
    assert not receiver.kv.partial  # its request ended: dropped
    assert_no_leak(receiver)
    assert_no_leak(sender)


def test_a_prompt_that_ran_before_is_held_by_key_without_its_partial_block(loaded, pair):
    sender, receiver, server = pair
    p = prompt(40, seed=8)
    generate(sender, "late", p, 1)  # not expected: the partial block is gone when it ends
    pinned = server.register("late", p)
    assert len(pinned.block_ids) == 2 and not pinned.tail
    received = pull_blocks(server.host, server.port, TOKEN, "late", pinned.block_ids,
                           engine_namespace(receiver))
    assert received.tail is None
    assert inject_blocks(receiver, p, received.blocks) == 2
    reference = generate(LLMEngine(loaded[0], loaded[1], num_kv_blocks=24), "ref", p, 4)
    assert generate(receiver, "late", p, 4) == reference
    assert receiver.kv.prefix_hits == 32
    server.close()
    server.poll()
    assert_no_leak(sender)


def test_the_endpoint_refuses_what_is_not_the_named_requests(pair):
    sender, receiver, server = pair
    a, b = prompt(48, 1), prompt(48, 2)
    generate(sender, "a", a, 1)
    generate(sender, "b", b, 1)
    pa, pb = server.register("a", a), server.register("b", b)
    ns = engine_namespace(receiver)
    args = (server.host, server.port)
    with pytest.raises(KVTransferError, match="bad token"):
        pull_blocks(*args, "wrong", "a", pa.block_ids, ns)
    with pytest.raises(KVTransferError, match="not held for request"):
        pull_blocks(*args, TOKEN, "a", pa.block_ids[:1] + pb.block_ids[:1], ns)
    with pytest.raises(KVTransferError, match="not held for request"):
        pull_blocks(*args, TOKEN, "a", [10**9], ns)
    with pytest.raises(KVTransferError, match="unknown, released or timed out"):
        pull_blocks(*args, TOKEN, "nobody", [], ns)
    with pytest.raises(KVTransferError, match="namespace"):
        pull_blocks(*args, TOKEN, "a", pa.block_ids, bytes(32))
    with pytest.raises(KVTransferError, match="list of integers"):
        pull_blocks(*args, TOKEN, "a", ["0"], ns)  # type: ignore[list-item]
    assert server.refusals >= 5
    # a receiver never takes blocks named for other tokens
    assert inject_blocks(receiver, a, pull_blocks(*args, TOKEN, "b", pb.block_ids, ns).blocks) == 0
    assert_no_leak(receiver)
    for r in ("a", "b"):
        assert release_blocks(*args, TOKEN, r)
    assert not release_blocks(*args, TOKEN, "a")  # twice: nothing held
    server.poll()
    assert_no_leak(sender)


def test_garbage_on_the_wire_is_refused(pair):
    _, _, server = pair
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(b"\x7f\xff\xff\xff" + b"x" * 10)  # a 2 GB header announced
        assert sock.recv(10) == b""  # the server hangs up
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(b"\x00\x00\x00\x03abc")
        assert sock.recv(10) == b""


def test_an_unreachable_peer_is_a_clear_error(pair):
    _, receiver, _ = pair
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match="cannot reach"):
        pull_blocks("127.0.0.1", port, TOKEN, "x", [0], engine_namespace(receiver), timeout=2)
    assert time.monotonic() - t0 < 30


def test_abandoned_blocks_are_freed_after_the_timeout(loaded):
    model, tok = loaded
    sender = LLMEngine(model, tok, num_kv_blocks=24, block_size=16)
    server = KVTransferServer(sender, TOKEN, pin_timeout_s=0.2)
    try:
        p = prompt(64, 3)
        generate(sender, "r", p, 1)
        assert len(server.register("r", p).block_ids) == 3
        deadline = time.monotonic() + 30
        while server.pinned_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.pinned_requests()
        server.poll()
        assert_no_leak(sender)
        with pytest.raises(KVTransferError, match="timed out"):
            pull_blocks(server.host, server.port, TOKEN, "r", [0], engine_namespace(sender))
    finally:
        server.close()


def test_pinned_blocks_are_bounded(loaded):
    model, tok = loaded
    sender = LLMEngine(model, tok, num_kv_blocks=24, block_size=16)
    server = KVTransferServer(sender, TOKEN, max_pinned_blocks=5)
    try:
        p, q = prompt(64, 4), prompt(64, 5)
        generate(sender, "p", p, 1)
        generate(sender, "q", q, 1)
        assert len(server.register("p", p).block_ids) == 3
        assert len(server.register("q", q).block_ids) == 2  # only what the bound leaves
        assert server.num_pinned_blocks == 5
        server.close()  # closing releases everything
        server.poll()
        assert_no_leak(sender)
    finally:
        server.close()


def test_the_endpoint_needs_a_token(loaded):
    model, tok = loaded
    with pytest.raises(ValueError, match="token"):
        KVTransferServer(LLMEngine(model, tok, num_kv_blocks=8), "")


def test_a_peer_not_on_the_allow_list_is_refused(loaded):
    model, tok = loaded
    sender = LLMEngine(model, tok, num_kv_blocks=8, block_size=16)
    server = KVTransferServer(sender, TOKEN, allow=("192.0.2.1",))  # loopback not allowed
    try:
        with pytest.raises(KVTransferError, match="not allowed"):
            pull_blocks(server.host, server.port, TOKEN, "x", [0], engine_namespace(sender))
        assert server.refusals == 1
    finally:
        server.close()

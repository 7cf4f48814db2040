"""KV transfer between engine processes over TCP (Chapter 13): pull a prompt's blocks by id.

The engine that computes a prompt (the *sender*, a prefill worker) is told to expect the
request (:meth:`KVTransferServer.expect`); when the request finishes, the blocks with its
prompt's K/V, the full ones and the partial last one, are held in its pool
(:func:`~.kv_connector.hold_finished_blocks`) and listed by block id. Another engine (the
*receiver*, a decode worker) connects, names the request and the block ids it was told about,
and gets each full block's key and bytes, and the partial block's tokens and bytes; it writes
the full ones into blocks of its own pool (other ids, another pool size) and names them
(:func:`~.kv_connector.inject_blocks`), keeps the partial one for the request
(:func:`~.kv_connector.stage_partial_block`), then runs the request as usual: its prefix lookup
finds the blocks, and it computes only the last prompt token. Then it says ``release`` and the
sender frees the blocks; a sender that hears nothing frees them after ``pin_timeout_s``.

The wire format is one connection per operation: a 4-byte big-endian length and a JSON header
each way, then, for a pull, the blocks' bytes back to back (vLLM moves the same bytes with
NIXL/RDMA; this is the TCP version). What the endpoint refuses, and why:

- a peer not in ``allow`` (loopback only by default; the server binds loopback by default);
- a wrong shared ``token`` (compared in constant time);
- a request id that is not registered (never was, released, or timed out), and block ids that
  are not among that request's: nobody reads another request's blocks through it;
- a receiver of another model (its cache namespace differs): the bytes would be wrong K/V.

Pinned blocks are bounded (``max_pinned_blocks``): past the bound, a registration pins fewer
blocks (a prefix) and the receiver computes the rest. The pool is touched only on the engine's
thread: releases and timeouts are queued and done by :meth:`KVTransferServer.poll`, which the
owner calls between steps (the server asks for it through ``schedule_poll``).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import queue
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from infer_lab.cache.block_pool import NONE_KEY, BlockKey
from infer_lab.cache.kv_tier import block_nbytes, read_block
from infer_lab.engine.engine import LLMEngine
from infer_lab.engine.kv_connector import (
    engine_namespace,
    hold_finished_blocks,
    pin_prompt_blocks,
    refuse_tensor_parallel,
)
from infer_lab.engine.kv_partial import PartialBlock
from infer_lab.engine.sequence import Sequence as EngineSequence

MAX_HEADER_BYTES = 1 << 16
_LEN = struct.Struct(">I")


class KVTransferError(RuntimeError):
    """A transfer did not happen (refused, unreachable, cut short); the receiver recomputes or
    reports it, never uses partial bytes."""


@dataclass
class Pinned:
    """A registered request's held blocks on the sender: the full blocks (``keys``) and, when
    ``tail`` names its tokens, the partial last block (the last id)."""

    block_ids: list[int]
    keys: list[BlockKey]
    expires: float
    tail: list[int] = field(default_factory=list)


@dataclass
class PulledBlocks:
    """What a pull brought: full blocks as ``(key, bytes)`` in order, and the partial one."""

    blocks: list[tuple[BlockKey, bytes]]
    tail: PartialBlock | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(p) for _, p in self.blocks) + (len(self.tail.payload) if self.tail else 0)


def send_frame(sock: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
    data = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(data)) + data + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise KVTransferError(f"the peer closed the connection after {len(buf)} of {n} "
                                  "bytes")
        buf += chunk
    return bytes(buf)


def recv_header(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_HEADER_BYTES:
        raise KVTransferError(f"a header of {n} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = json.loads(recv_exact(sock, n))
    except ValueError:
        raise KVTransferError("a header that is not JSON") from None
    if not isinstance(header, dict):
        raise KVTransferError("a header that is not a JSON object")
    return header


class KVTransferServer:
    """The sender's transfer endpoint: a TCP server thread over the engine's pinned blocks."""

    def __init__(self, engine: LLMEngine, token: str, host: str = "127.0.0.1", port: int = 0,
                 allow: Sequence[str] = ("127.0.0.1", "::1"), pin_timeout_s: float = 30.0,
                 max_pinned_blocks: int | None = None,
                 schedule_poll: Callable[[Callable[[], None]], None] | None = None) -> None:
        if not token:
            raise ValueError("the KV transfer endpoint needs a shared token")
        refuse_tensor_parallel(engine, "a KV transfer endpoint")
        self.engine, self.token, self.allow = engine, token, frozenset(allow)
        self.pin_timeout_s = pin_timeout_s
        self.max_pinned_blocks = (engine.kv.num_blocks // 2 if max_pinned_blocks is None
                                  else max_pinned_blocks)
        self.schedule_poll = schedule_poll
        self.namespace = engine_namespace(engine)
        self.block_nbytes = block_nbytes(engine.runner.cache)
        self._pinned: dict[str, Pinned] = {}
        self._expected: dict[str, float] = {}  # request id -> when to stop expecting it
        self._lock = threading.Lock()
        self._to_free: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        self.num_pinned_blocks = 0
        self.bytes_sent = 0
        self.refusals = 0
        self._tcp = _TCPServer((host, port), _Handler)
        self._tcp.owner = self
        self.host, self.port = self._tcp.server_address[:2]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._tcp.serve_forever, name="kv-transfer",
                                          daemon=True),
                         threading.Thread(target=self._expire_loop, name="kv-expire",
                                          daemon=True)]
        for t in self._threads:
            t.start()
        engine.kv.on_finished = self._on_finished

    # ------------------------------------------------------------------ engine thread
    def _on_finished(self, seq: EngineSequence) -> None:
        """The KV manager's hook: an expected request finished; hold its prompt's blocks."""
        request_id = seq.request.request_id
        with self._lock:
            if self._expected.pop(request_id, None) is None:
                return
        room = max(0, self.max_pinned_blocks - self.num_pinned_blocks)
        blocks, keys, tail = hold_finished_blocks(self.engine, seq, room)
        self._add(request_id, Pinned(blocks, keys, time.monotonic() + self.pin_timeout_s, tail))

    def register(self, request_id: str, token_ids: Sequence[int]) -> Pinned:
        """Hold the cached full blocks of ``token_ids`` for ``request_id`` (engine thread): for a
        prompt that ran without :meth:`expect`, whose partial last block is gone."""
        self.poll()
        room = max(0, self.max_pinned_blocks - self.num_pinned_blocks)
        blocks, keys = pin_prompt_blocks(self.engine, token_ids, room)
        pinned = Pinned(blocks, keys, time.monotonic() + self.pin_timeout_s)
        self._add(request_id, pinned)
        self.poll()
        return pinned

    def _add(self, request_id: str, pinned: Pinned) -> None:
        with self._lock:
            old = self._pinned.pop(request_id, None)
            self._pinned[request_id] = pinned
            self.num_pinned_blocks += len(pinned.block_ids)
        if old is not None:
            self._drop(old)

    def poll(self) -> None:
        """Free the blocks of released and timed-out requests (engine thread)."""
        while True:
            try:
                blocks = self._to_free.get_nowait()
            except queue.Empty:
                return
            self.engine.kv.pool.free_blocks(reversed(blocks))

    # ------------------------------------------------------------------ any thread
    def expect(self, request_id: str) -> None:
        """``request_id`` is about to run for a remote decode: when it finishes, hold its
        prompt's blocks (before the scheduler frees them, so the partial last one is kept)."""
        with self._lock:
            self._expected[request_id] = time.monotonic() + self.pin_timeout_s

    def forget(self, request_id: str) -> None:
        """Stop expecting ``request_id`` (it ended, or never started)."""
        with self._lock:
            self._expected.pop(request_id, None)

    def pinned(self, request_id: str) -> Pinned | None:
        with self._lock:
            return self._pinned.get(request_id)

    def release(self, request_id: str) -> bool:
        """Stop serving ``request_id``'s blocks; they are freed at the next :meth:`poll`."""
        with self._lock:
            pinned = self._pinned.pop(request_id, None)
        if pinned is None:
            return False
        self._drop(pinned)
        return True

    def pinned_requests(self) -> list[str]:
        with self._lock:
            return list(self._pinned)

    def close(self) -> None:
        """Stop serving and release every pinned request (freed at the next poll)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._tcp.shutdown()
        self._tcp.server_close()
        if self.engine.kv.on_finished == self._on_finished:
            self.engine.kv.on_finished = None
        for request_id in self.pinned_requests():
            self.release(request_id)

    def _drop(self, pinned: Pinned) -> None:
        with self._lock:
            self.num_pinned_blocks -= len(pinned.block_ids)
        if pinned.block_ids:
            self._to_free.put(pinned.block_ids)
            if self.schedule_poll is not None:
                self.schedule_poll(self.poll)

    def _expire_loop(self) -> None:
        while not self._stop.wait(min(1.0, self.pin_timeout_s / 4)):
            now = time.monotonic()
            with self._lock:
                late = [r for r, p in self._pinned.items() if p.expires <= now]
                for r in [r for r, t in self._expected.items() if t <= now]:
                    del self._expected[r]
            for request_id in late:
                self.release(request_id)

    # ------------------------------------------------------------------ serving thread
    def handle(self, sock: socket.socket, peer: str) -> None:
        if peer not in self.allow:
            self.refusals += 1
            send_frame(sock, {"ok": False, "error": f"peer {peer} is not allowed"})
            return
        header = recv_header(sock)
        if not hmac.compare_digest(str(header.get("token", "")).encode(), self.token.encode()):
            self.refusals += 1
            send_frame(sock, {"ok": False, "error": "bad token"})
            return
        op, request_id = header.get("op"), header.get("request_id")
        if not isinstance(request_id, str):
            send_frame(sock, {"ok": False, "error": "request_id must be a string"})
        elif op == "release":
            send_frame(sock, {"ok": self.release(request_id)})
        elif op == "pull":
            self._pull(sock, request_id, header)
        else:
            send_frame(sock, {"ok": False, "error": f"unknown op {op!r}"})

    def _pull(self, sock: socket.socket, request_id: str, header: dict[str, Any]) -> None:
        ids = header.get("block_ids")
        if header.get("namespace") != self.namespace.hex():
            self.refusals += 1
            send_frame(sock, {"ok": False, "error": "the receiver runs another model or cache "
                              "format (namespace differs)"})
            return
        if not isinstance(ids, list) or not all(type(b) is int for b in ids):
            send_frame(sock, {"ok": False, "error": "block_ids must be a list of integers"})
            return
        with self._lock:  # held while reading: a release cannot free a block mid-read
            pinned = self._pinned.get(request_id)
            if pinned is None:
                self.refusals += 1
                send_frame(sock, {"ok": False, "error": f"request {request_id!r} has no blocks "
                                  "here (unknown, released or timed out)"})
                return
            index = {b: i for i, b in enumerate(pinned.block_ids)}
            if any(b not in index for b in ids):
                self.refusals += 1
                send_frame(sock, {"ok": False, "error": f"block ids not held for request "
                                  f"{request_id!r}"})
                return
            cache = self.engine.runner.cache
            body = b"".join(read_block(cache, b) for b in ids)
            # the partial block has no key: it travels with its tokens and its parent's key
            nfull = len(pinned.keys)
            keys = [pinned.keys[index[b]].hex() if index[b] < nfull else None for b in ids]
            reply: dict[str, Any] = {"ok": True, "keys": keys, "block_nbytes": self.block_nbytes}
            if pinned.tail and pinned.block_ids[-1] in ids:
                reply["tail"] = {"tokens": pinned.tail,
                                 "parent": (pinned.keys[-1] if nfull else NONE_KEY).hex()}
        send_frame(sock, reply, body)
        self.bytes_sent += len(body)


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: KVTransferServer

    def __init__(self, address: tuple[str, int], handler: type) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(30.0)
        # a peer's broken frame is its problem: it gets a cut connection and recomputes
        with contextlib.suppress(OSError, KVTransferError):
            self.server.owner.handle(sock, self.client_address[0])  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- the receiver's side
def pull_blocks(host: str, port: int, token: str, request_id: str, block_ids: Sequence[int],
                namespace: bytes, timeout: float = 10.0) -> PulledBlocks:
    """``block_ids``' K/V from the sender: each full block's ``(key, bytes)``, and the partial
    last block's tokens and bytes if it is among them; raises :class:`KVTransferError` if
    anything is refused or cut short."""
    header = {"op": "pull", "token": token, "request_id": request_id,
              "block_ids": list(block_ids), "namespace": namespace.hex()}
    reply, sock = _call(host, port, header, timeout)
    with sock:
        keys, size = reply.get("keys"), reply.get("block_nbytes")
        if not isinstance(keys, list) or len(keys) != len(block_ids) or not isinstance(size, int):
            raise KVTransferError("a malformed reply to a pull")
        try:
            body = recv_exact(sock, size * len(keys))
        except OSError as e:
            raise KVTransferError(f"the KV transfer from {host}:{port} was cut: {e}") from e
    payloads = [body[i * size : (i + 1) * size] for i in range(len(keys))]
    try:
        blocks = [(bytes.fromhex(k), p) for k, p in zip(keys, payloads) if k is not None]
        tail = None
        if len(blocks) < len(keys):  # one keyless block, the last: the partial one
            spec = reply.get("tail")
            if len(blocks) != len(keys) - 1 or keys[-1] is not None or not isinstance(spec, dict):
                raise ValueError
            tokens = spec.get("tokens")
            if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                raise ValueError
            tail = PartialBlock(tokens, bytes.fromhex(spec["parent"]), payloads[-1])
    except (TypeError, ValueError, KeyError):
        raise KVTransferError("a malformed key in a pull's reply") from None
    return PulledBlocks(blocks, tail)


def release_blocks(host: str, port: int, token: str, request_id: str,
                   timeout: float = 10.0) -> bool:
    """Tell the sender it may free ``request_id``'s blocks; False if it held none."""
    reply, sock = _call(host, port, {"op": "release", "token": token,
                                     "request_id": request_id}, timeout)
    sock.close()
    return bool(reply.get("ok"))


def _call(host: str, port: int, header: dict[str, Any], timeout: float
          ) -> tuple[dict[str, Any], socket.socket]:
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise KVTransferError(f"cannot reach the KV transfer endpoint {host}:{port}: {e}") from e
    try:
        send_frame(sock, header)
        reply = recv_header(sock)
    except (OSError, KVTransferError) as e:
        sock.close()
        raise KVTransferError(f"the KV transfer from {host}:{port} failed: {e}") from e
    if header["op"] == "pull" and not reply.get("ok"):
        sock.close()
        raise KVTransferError(f"the KV transfer endpoint refused: {reply.get('error')}")
    return reply, sock

"""Prefill/decode disaggregation behind vLLM's router (Chapter 13): ``kv_transfer_params``.

``vllm-router --vllm-pd-disaggregation --prefill P --decode D`` (0.1.17, its default NIXL
protocol) sends each request twice. What it sends was captured from the real router (the test
``tests/test_pd_router.py`` checks it again on every run):

1. to the prefill worker: the request with ``max_tokens=1``, ``stream=false``, ``min_tokens=1``
   and ``kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false, ...null}``.
   A worker started with ``--kv-role prefill`` runs the prompt, holds the blocks of its KV as
   it finishes, the partial last one too
   (:class:`~infer_lab.engine.kv_transfer.KVTransferServer`) and answers with a top-level
   ``kv_transfer_params`` in vLLM's keys: ``do_remote_prefill``, ``remote_engine_id``,
   ``remote_request_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``, ``tp_size``.
2. to the decode worker: the original request plus those params, verbatim. A worker started
   with ``--kv-role decode`` pulls the blocks from ``remote_host:remote_port`` (only from a
   peer on its ``--kv-peers`` list), tells the prefill side to release them, writes them into
   its own pool and runs the request, computing only the tokens after the received blocks
   (with every block received: the last prompt token, whose logits give the first token).

What goes wrong costs a recompute or a clear error, never wrong tokens: malformed params are a
400; a peer not on the list is a 400 (a client must not make the worker connect anywhere); an
unreachable, dead or refusing peer (blocks freed by timeout, ids of another request) is a local
recompute with a warning (``--kv-on-failure error`` makes it a 502 instead); received blocks
whose keys are not this prompt's own are not used. A worker without a KV role refuses
``kv_transfer_params`` (400), and so does a prefill worker asked to stream the first stage
(vLLM takes it, but sends the params only in a non-streaming answer: they would be lost). The
shared token comes from ``INFER_LAB_KV_TOKEN`` (not argv).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request

from infer_lab import settings
from infer_lab.engine import RequestOutput
from infer_lab.engine.kv_connector import (
    attach_kv_tier,
    engine_namespace,
    inject_blocks,
    refuse_eagle,
    refuse_tensor_parallel,
    stage_partial_block,
)
from infer_lab.engine.kv_transfer import (
    KVTransferError,
    KVTransferServer,
    PulledBlocks,
    pull_blocks,
    release_blocks,
)
from infer_lab.serve.async_engine import AsyncEngine
from infer_lab.serve.errors import APIError
from infer_lab.serve.kv_args import TOKEN_ENV
from infer_lab.serve.protocol import SamplingFields

log = logging.getLogger("infer_lab.serve")
MAX_REMOTE_BLOCKS = 1 << 16
T = TypeVar("T")


@dataclass
class KVRoleConfig:
    """How this worker takes part: ``role`` "prefill", "decode" or "both"."""

    role: str
    token: str
    host: str = "127.0.0.1"  # where the transfer endpoint binds (loopback by default)
    port: int = 0  # 0: any free port
    advertise_host: str | None = None  # what the prefill side tells the decode side
    peers: frozenset[tuple[str, int]] = frozenset()  # endpoints a decode worker may pull from
    allow: tuple[str, ...] = ("127.0.0.1", "::1")  # who may connect to the endpoint
    pin_timeout_s: float = 30.0
    pull_timeout_s: float = 10.0
    max_pinned_blocks: int | None = None  # None: half the pool (KVTransferServer's default)
    on_failure: str = "recompute"  # or "error"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"--kv-role must be prefill, decode or both, got {self.role!r}")
        if not self.token:
            raise ValueError(f"a KV role needs a shared token in ${TOKEN_ENV}")
        if self.on_failure not in ("recompute", "error"):
            raise ValueError("--kv-on-failure must be recompute or error")
        if self.max_pinned_blocks is not None and self.max_pinned_blocks < 0:
            raise ValueError(f"--kv-max-pinned-blocks must be 0 or more, got "
                             f"{self.max_pinned_blocks}")
        if not self.pin_timeout_s > 0 or not self.pull_timeout_s > 0:
            raise ValueError("--kv-pin-timeout and --kv-pull-timeout must be positive")

    @property
    def produces(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def consumes(self) -> bool:
        return self.role in ("decode", "both")


@dataclass
class KVParams:
    """A request's validated ``kv_transfer_params``."""

    remote_decode: bool  # this worker prefills for another
    remote_prefill: bool  # this worker pulls what another prefilled
    host: str = ""
    port: int = 0
    request_id: str = ""
    engine_id: str = ""
    block_ids: list[int] = field(default_factory=list)


class KVDisagg:
    """A worker's KV role: its transfer endpoint (prefill) and its pulls (decode)."""

    def __init__(self, engine: AsyncEngine, config: KVRoleConfig) -> None:
        self.engine, self.config = engine, config
        refuse_tensor_parallel(engine.engine, f"--kv-role {config.role}")
        if config.consumes:
            refuse_eagle(engine.engine, f"--kv-role {config.role}")
        self.namespace = engine_namespace(engine.engine)
        self.endpoint: KVTransferServer | None = None
        if config.produces:
            self.endpoint = KVTransferServer(
                engine.engine, config.token, config.host, config.port, config.allow,
                config.pin_timeout_s, config.max_pinned_blocks, schedule_poll=self._schedule)
        self.pulled_blocks = 0
        self.failed_pulls = 0

    def _schedule(self, fn: Callable[[], None]) -> None:
        if self.engine.state != "dead":
            self.engine._submit(fn)

    async def on_engine(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine's thread (the pool is not thread-safe) and await it."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def call() -> None:
            try:
                result = fn()
            except Exception as e:  # handed back to the awaiting request
                loop.call_soon_threadsafe(_settle, done, None, e)
                return
            loop.call_soon_threadsafe(_settle, done, result, None)

        self.engine._submit(call)
        return await done

    # ------------------------------------------------------------------ decode side
    async def before(self, params: KVParams, request_id: str, ids: list[int]) -> None:
        """Pull the prefilled blocks into this engine's pool (or leave the prompt to compute);
        on the prefill side, have the endpoint hold the request's blocks when it finishes."""
        if params.remote_decode and self.endpoint is not None:
            self.endpoint.expect(request_id)
        if not params.remote_prefill:
            return
        cfg = self.config
        try:
            received = await asyncio.to_thread(
                pull_blocks, params.host, params.port, cfg.token, params.request_id,
                params.block_ids, self.namespace, cfg.pull_timeout_s)
        except KVTransferError as e:
            self.failed_pulls += 1
            log.warning("request %s: KV pull failed (%s); %s", request_id, e,
                        "computing the prompt here" if cfg.on_failure == "recompute" else
                        "failing the request")
            if cfg.on_failure == "error":
                raise APIError(502, f"the KV transfer from the prefill worker failed: {e}",
                               "server_error", code="kv_transfer_failed") from e
            return
        await asyncio.to_thread(self._release, params)
        used, tail = await self.on_engine(lambda: self._take(request_id, ids, received))
        self.pulled_blocks += used + (tail > 0)
        sent = len(received.blocks) + (received.tail is not None)
        if used + (tail > 0) < sent:
            log.warning("request %s: %d of %d received KV blocks did not match the prompt",
                        request_id, sent - used - (tail > 0), sent)

    def _take(self, request_id: str, ids: list[int], received: PulledBlocks) -> tuple[int, int]:
        """Engine thread: the full blocks into the pool, then the partial one, if it follows
        them all, kept for this request; (full blocks used, tokens of the partial one)."""
        engine = self.engine.engine
        used = inject_blocks(engine, ids, received.blocks)
        tail = received.tail
        if tail is None or used < len(received.blocks):
            return used, 0
        return used, stage_partial_block(engine, request_id, ids, used, tail)

    def _release(self, params: KVParams) -> None:
        try:
            release_blocks(params.host, params.port, self.config.token, params.request_id,
                           self.config.pull_timeout_s)
        except KVTransferError as e:  # the sender frees them after its timeout anyway
            log.warning("KV release of %s failed: %s", params.request_id, e)

    # ------------------------------------------------------------------ prefill side
    async def after(self, params: KVParams, request_id: str, ids: list[int],
                    final: RequestOutput) -> dict[str, Any]:
        """Hold the prompt's blocks for the decode worker; the response's ``kv_transfer_params``."""
        if not params.remote_decode or self.endpoint is None:
            return {}
        endpoint = self.endpoint
        endpoint.forget(request_id)
        # held as the request finished (expect); else (not expected) its cached full blocks
        pinned = endpoint.pinned(request_id) or await self.on_engine(
            lambda: endpoint.register(request_id, ids))
        return {"kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id, "remote_request_id": request_id,
            "remote_block_ids": pinned.block_ids,
            "remote_host": self.config.advertise_host or endpoint.host,
            "remote_port": endpoint.port, "tp_size": 1,
        }}

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()


def _settle(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


# ---------------------------------------------------------------------- the routes' hook
def kv_params(request: Request, body: SamplingFields) -> KVParams | None:
    """Take ``kv_transfer_params`` out of ``body`` and validate them against this worker's role;
    None when the request has none. A prefill for a remote decode may carry vLLM's
    ``min_tokens=1`` (its one token is thrown away), which is dropped here."""
    extra = body.model_extra or {}
    raw = extra.pop("kv_transfer_params", None)
    if raw is None:
        return None
    disagg: KVDisagg | None = getattr(request.app.state, "kv_disagg", None)
    if disagg is None:
        raise APIError(400, "kv_transfer_params: this server has no KV role (start it with "
                       "--kv-role)", param="kv_transfer_params")
    params = parse_kv_params(raw)
    cfg = disagg.config
    if params.remote_decode:
        if not cfg.produces:
            raise _bad("do_remote_decode: this worker is not a prefill worker")
        if getattr(body, "stream", False):
            # vLLM accepts a streamed prefill but no stream chunk carries kv_transfer_params
            # (only its non-streaming responses do: ``request_output_to_completion_response``
            # and ``chat_completion_full_generator``), so the caller never learns the blocks'
            # ids and they sit pinned until the timeout. Refused here instead, by name.
            raise _bad("do_remote_decode: a prefill for a remote decode cannot stream (its "
                       "answer, kv_transfer_params, is sent whole: use stream=false, as "
                       "vllm-router does)")
        if extra.get("min_tokens") in (0, 1):
            extra.pop("min_tokens")
    if params.remote_prefill:
        if not cfg.consumes:
            raise _bad("do_remote_prefill: this worker is not a decode worker")
        if (params.host, params.port) not in cfg.peers:
            raise _bad(f"remote_host:remote_port {params.host}:{params.port} is not one of this "
                       "worker's --kv-peers")
    return params


async def kv_before(request: Request, params: KVParams | None, request_id: str,
                    ids: list[int]) -> None:
    """Before the engine sees the request: a decode worker pulls the prefilled blocks."""
    if params is not None:
        await request.app.state.kv_disagg.before(params, request_id, ids)


async def kv_after(request: Request, params: KVParams | None, request_id: str, ids: list[int],
                   final: RequestOutput) -> dict[str, Any]:
    """After the last output: a prefill worker's extra response fields (else none)."""
    if params is None:
        return {}
    return await request.app.state.kv_disagg.after(params, request_id, ids, final)


def parse_kv_params(raw: Any) -> KVParams:
    """vLLM's ``kv_transfer_params`` (NIXL shape), checked field by field."""
    if not isinstance(raw, dict):
        raise _bad("must be a JSON object")
    decode, prefill = raw.get("do_remote_decode"), raw.get("do_remote_prefill")
    if not isinstance(decode, (bool, type(None))) or not isinstance(prefill, (bool, type(None))):
        raise _bad("do_remote_decode and do_remote_prefill must be booleans")
    if decode and prefill:
        raise _bad("do_remote_decode and do_remote_prefill cannot both be true")
    params = KVParams(bool(decode), bool(prefill))
    if not prefill:
        return params
    host, port, rid = raw.get("remote_host"), raw.get("remote_port"), raw.get("remote_request_id")
    blocks, engine_id = raw.get("remote_block_ids"), raw.get("remote_engine_id")
    if not isinstance(host, str) or not host or len(host) > 255:
        raise _bad("remote_host must be a host name")
    if type(port) is not int or not 0 < port < 65536:
        raise _bad("remote_port must be a port number")
    if not isinstance(rid, str) or not rid or len(rid) > 256:
        raise _bad("remote_request_id must be a non-empty string")
    if not isinstance(engine_id, (str, type(None))):
        raise _bad("remote_engine_id must be a string")
    if (not isinstance(blocks, list) or len(blocks) > MAX_REMOTE_BLOCKS
            or not all(type(b) is int and b >= 0 for b in blocks)):
        raise _bad("remote_block_ids must be a list of block ids")
    if raw.get("tp_size", 1) != 1:
        raise _bad("tp_size: only 1 is supported")
    return KVParams(False, True, host, port, rid, engine_id or "", blocks)


def _bad(message: str) -> APIError:
    return APIError(400, f"kv_transfer_params: {message}", param="kv_transfer_params",
                    code="invalid_kv_transfer_params")


# ---------------------------------------------------------------------- command line
def install_kv(app: FastAPI, args: argparse.Namespace) -> None:
    """Give the app's engine the KV role and tier the flags ask for."""
    engine: AsyncEngine = app.state.server.engine
    if args.kv_tier_dir:
        attach_kv_tier(engine.engine, args.kv_tier_dir, args.kv_tier_bytes)
    if args.kv_role is None:
        return
    config = KVRoleConfig(
        args.kv_role, settings.KV_TOKEN.get(), args.kv_transfer_host,
        args.kv_transfer_port, peers=frozenset(_peers(args.kv_peers)),
        allow=tuple(a for a in args.kv_allow.split(",") if a),
        pin_timeout_s=args.kv_pin_timeout, pull_timeout_s=args.kv_pull_timeout,
        max_pinned_blocks=args.kv_max_pinned_blocks, on_failure=args.kv_on_failure)
    app.state.kv_disagg = KVDisagg(engine, config)


def _peers(text: str) -> list[tuple[str, int]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--kv-peers: {item!r} is not host:port")
        out.append((host.strip("[]"), int(port)))
    return out

"""Chapter 13's disaggregation when things go wrong between the two stages, worker by worker.

Blocks nobody pulls are freed after ``--kv-pin-timeout`` and a pull after that costs the decode
request a recompute or a 502, as ``--kv-on-failure`` says; ``--kv-max-pinned-blocks`` bounds
what abandoned transfers hold; a prefill worker that hangs (the wait of ``--kv-pull-timeout``)
or is killed between the stages, or a transfer cut short (a stand-in endpoint), costs a
recompute or a clear error, never a hang or a half-received block used. Whenever there is output,
its greedy tokens equal a colocated server's; afterwards every pool is full again. (The happy
path through the real router is ``tests/test_pd_router.py``.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from infer_lab.cache.kv_tier import block_nbytes
from infer_lab.engine.kv_connector import prompt_keys
from infer_lab.engine.kv_transfer import (
    KVTransferError,
    pull_blocks,
    recv_header,
    release_blocks,
    send_frame,
)
from infer_lab.serve.disagg import install_kv
from infer_lab.serve.kv_args import add_kv_arguments
from infer_lab.serve.launch import free_port, launch
from infer_lab.serve.server import make_app
from tests.live_server import metric, running, wait_for

TOKEN = "pd-faults-token"
TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, "
        "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon "
        "the face of the waters. And God said, Let there be light: and there was light. ")
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
HTTP_TIMEOUT = 180.0  # a request that hangs fails the test here; a loaded machine never does
HUNG_BOUND = 120.0  # a pull from a hung worker ends near --kv-pull-timeout, far below this
FIRST_STAGE = {"max_tokens": 1, "stream": False, "min_tokens": 1,
               "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                      "remote_engine_id": None, "remote_block_ids": None,
                                      "remote_host": None, "remote_port": None}}


@contextlib.contextmanager
def kv_token() -> Iterator[None]:
    old = os.environ.get("INFER_LAB_KV_TOKEN")
    os.environ["INFER_LAB_KV_TOKEN"] = TOKEN
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("INFER_LAB_KV_TOKEN")
        else:
            os.environ["INFER_LAB_KV_TOKEN"] = old


@contextlib.contextmanager
def worker(*flags: str, num_kv_blocks: int = 64) -> Iterator[tuple[str, FastAPI]]:
    """An in-process ``infer-lab serve`` with these KV flags (the bundled model, fp32)."""
    parser = argparse.ArgumentParser()
    add_kv_arguments(parser)
    app = make_app(None, device="cpu", dtype="fp32", num_kv_blocks=num_kv_blocks,
                   max_num_seqs=4)
    with kv_token():
        install_kv(app, parser.parse_args(list(flags)))
    try:
        with running(app) as base:
            yield base, app
    finally:
        app.state.kv_disagg.close()


@pytest.fixture(scope="module")
def ports() -> dict[str, int]:
    """The transfer ports of this file's prefill endpoints, fixed so the decoders can list them."""
    return {name: free_port() for name in ("timeout", "bound", "process", "cut")}


@pytest.fixture(scope="module")
def decoders(ports):
    """Two decode workers, one per ``--kv-on-failure`` policy, allowed to pull from them all."""
    peers = ",".join(f"127.0.0.1:{p}" for p in ports.values())
    with worker("--kv-role", "decode", "--kv-peers", peers) as rec, \
            worker("--kv-role", "decode", "--kv-peers", peers, "--kv-on-failure", "error",
                   "--kv-pull-timeout", "5") as err:
        yield {"recompute": rec, "error": err}


def post(base: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=body, timeout=HTTP_TIMEOUT)


def text_of(base: str, prompt: str | list[int], **extra: Any) -> str:
    r = post(base, {"prompt": prompt, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def first_stage(base: str, prompt: str) -> dict[str, Any]:
    """What vllm-router sends the prefill worker; its ``kv_transfer_params``."""
    r = post(base, {"prompt": prompt, **GREEDY, **FIRST_STAGE})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def assert_kv_transfer_502(r: httpx.Response, why: str) -> None:
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "kv_transfer_failed" and why in error["message"]


def pools_full(*bases: str) -> bool:
    """Every block of every worker back in its pool (polled: frees happen between steps)."""
    return wait_for(lambda: all(metric(b, "kv_cache_blocks_used") == 0 for b in bases),
                    timeout=60)


def test_blocks_nobody_pulls_are_freed_after_the_timeout_and_a_late_pull_is_refused(decoders,
                                                                                   ports):
    rec, err = decoders["recompute"], decoders["error"]
    with worker("--kv-role", "prefill", "--kv-transfer-port", str(ports["timeout"]),
                "--kv-pin-timeout", "0.5") as (prefill, app):
        endpoint = app.state.kv_disagg.endpoint
        prompts = [f"Late {i}. " + TEXT * 2 for i in range(2)]
        # the reference: the prefill worker serving the prompt as a colocated server does
        want = [text_of(prefill, p) for p in prompts]
        params = [first_stage(prefill, p) for p in prompts]
        assert all(len(p["remote_block_ids"]) > 1 for p in params)
        # nobody pulls: the endpoint lets go of them and the prefill pool is full again
        assert wait_for(lambda: not endpoint.pinned_requests(), timeout=60)
        assert pools_full(prefill)
        with pytest.raises(KVTransferError, match="timed out"):
            pull_blocks("127.0.0.1", ports["timeout"], TOKEN, params[0]["remote_request_id"],
                        params[0]["remote_block_ids"], endpoint.namespace)
        failed = rec[1].state.kv_disagg.failed_pulls
        # the decode side: --kv-on-failure recompute computes the prompt, same tokens
        assert text_of(rec[0], prompts[0], kv_transfer_params=params[0]) == want[0]
        assert rec[1].state.kv_disagg.failed_pulls == failed + 1
        # --kv-on-failure error: a 502 that says why; the worker goes on serving others
        r = post(err[0], {"prompt": prompts[1], **GREEDY, "kv_transfer_params": params[1]})
        assert_kv_transfer_502(r, "timed out")
        assert text_of(err[0], prompts[1]) == want[1]
        assert pools_full(prefill, rec[0], err[0])


def test_pinned_blocks_are_bounded_so_abandoned_transfers_cannot_exhaust_the_pool(decoders,
                                                                                  ports):
    rec = decoders["recompute"][0]
    bound = 5
    with worker("--kv-role", "prefill", "--kv-transfer-port", str(ports["bound"]),
                "--kv-pin-timeout", "600", "--kv-max-pinned-blocks", str(bound),
                num_kv_blocks=32) as (prefill, app):
        endpoint = app.state.kv_disagg.endpoint
        prompts = [f"Bound {i}. " + TEXT for i in range(8)]  # ~5 blocks each: 40 > 32
        params = [first_stage(prefill, p) for p in prompts]  # all abandoned, none pulled
        held = [len(p["remote_block_ids"]) for p in params]
        assert sum(held) == bound and held[0] > 0  # the first ones until the bound, then none
        assert endpoint.num_pinned_blocks == bound
        assert wait_for(lambda: metric(prefill, "kv_cache_blocks_used") == bound)
        # the pool is not exhausted: a prompt of 24 blocks still runs beside the pinned ones
        r = post(prefill, {"prompt": "Long. " + TEXT * 6, **GREEDY})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        # a request that got fewer blocks than its prompt has (or none) is right on the decode
        # side, which computes the rest: it takes only the full blocks it was sent
        tokens = [post(prefill, {"prompt": p, **GREEDY, "max_tokens": 1}).json()["usage"][
            "prompt_tokens"] for p in prompts[:3]]
        short = 0
        for p, n, pp, k in zip(prompts[:3], tokens, params[:3], held[:3], strict=True):
            if k == -(-(n - 1) // 16):
                continue  # got all its blocks (the first)
            short += 1
            want = text_of(prefill, p)
            hits = metric(rec, "prefix_cache_hits_total")
            assert text_of(rec, p, kv_transfer_params=pp) == want
            assert metric(rec, "prefix_cache_hits_total") - hits == 16 * k
        assert short >= 2
        # released by hand (the decoder released what it pulled): the bound frees up again
        for pp in params:
            release_blocks("127.0.0.1", ports["bound"], TOKEN, pp["remote_request_id"])
        assert pools_full(prefill, rec)
        again = first_stage(prefill, prompts[-1])
        assert len(again["remote_block_ids"]) == max(held)
        release_blocks("127.0.0.1", ports["bound"], TOKEN, again["remote_request_id"])
        assert pools_full(prefill)


def test_a_prefill_worker_that_hangs_or_dies_between_the_stages(decoders, ports):
    """A real process: stopped (SIGSTOP: the connection opens, nothing answers) and then killed
    (nothing listens) after its first stages. Recompute or 502, never a hang: the hung one
    costs the wait of ``--kv-pull-timeout`` (at least that, and far less than the HTTP
    timeout), the killed one an immediate refusal."""
    (rec, rec_app), (err, err_app) = decoders["recompute"], decoders["error"]
    waits = {rec: rec_app.state.kv_disagg.config.pull_timeout_s,
             err: err_app.state.kv_disagg.config.pull_timeout_s}
    with kv_token():
        prefill = launch("--device", "cpu", "--dtype", "fp32", "--num-kv-blocks", "64",
                         "--kv-role", "prefill", "--kv-transfer-port", str(ports["process"]),
                         "--kv-pin-timeout", "600", timeout=300)
    try:
        prompts = [f"Gone {i}. " + TEXT * 2 for i in range(4)]
        want = [text_of(prefill.base, p) for p in prompts]
        params = [first_stage(prefill.base, p) for p in prompts]
        prefill.process.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        assert text_of(rec, prompts[0], kv_transfer_params=params[0]) == want[0]
        assert waits[rec] <= time.monotonic() - start < HUNG_BOUND
        start = time.monotonic()
        r = post(err, {"prompt": prompts[1], **GREEDY, "kv_transfer_params": params[1]})
        assert waits[err] <= time.monotonic() - start < HUNG_BOUND
        assert_kv_transfer_502(r, "failed")
        prefill.process.kill()
        prefill.process.wait(timeout=60)
        assert text_of(rec, prompts[2], kv_transfer_params=params[2]) == want[2]
        r = post(err, {"prompt": prompts[3], **GREEDY, "kv_transfer_params": params[3]})
        assert_kv_transfer_502(r, "cannot reach")
        assert text_of(err, prompts[3]) == want[3]  # the next request is served
        assert pools_full(rec, err)
    finally:
        if prefill.process.poll() is None:
            prefill.process.kill()
            prefill.process.wait(timeout=60)
        prefill.log.close()


def _cutting_endpoint(port: int, nbytes: int, keys: list[str]) -> socket.socket:
    """A stand-in transfer endpoint that dies mid-pull: it answers the header with ``keys``
    (hex), sends half of the first block's bytes and hangs up (a prefill worker killed during
    the transfer)."""
    listener = socket.create_server(("127.0.0.1", port))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                ids = recv_header(conn).get("block_ids", [])
                send_frame(conn, {"ok": True, "keys": keys[:len(ids)], "block_nbytes": nbytes},
                           b"\0" * (nbytes // 2))

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_a_transfer_cut_short_is_never_used(decoders, ports):
    """A stand-in endpoint (not a prefill worker) names the prompt's own blocks by their real
    keys and dies half-way through the first: nothing of it is used on the decode side."""
    rec, err = decoders["recompute"], decoders["error"]
    engine = rec[1].state.kv_disagg.engine.engine
    nbytes = block_nbytes(engine.runner.cache)
    ids = engine.tokenizer.encode("Cut. " + TEXT * 2)  # sent as ids: these are the prompt's
    keys = [k.hex() for k in prompt_keys(engine, ids)]
    assert len(keys) > 1
    listener = _cutting_endpoint(ports["cut"], nbytes, keys)
    try:
        want = text_of(err[0], ids)  # the reference: a plain request, on the other worker
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
                  "remote_request_id": "cmpl-cut", "remote_block_ids": list(range(len(keys))),
                  "remote_host": "127.0.0.1", "remote_port": ports["cut"], "tp_size": 1}
        pulled = [d[1].state.kv_disagg.pulled_blocks for d in (rec, err)]
        hits = [metric(d[0], "prefix_cache_hits_total") for d in (rec, err)]
        assert text_of(rec[0], ids, kv_transfer_params=params) == want
        r = post(err[0], {"prompt": ids, **GREEDY, "kv_transfer_params": params})
        assert_kv_transfer_502(r, "closed the connection")
        assert [d[1].state.kv_disagg.pulled_blocks for d in (rec, err)] == pulled
        assert [metric(d[0], "prefix_cache_hits_total") for d in (rec, err)] == hits
        assert pools_full(rec[0], err[0])
    finally:
        listener.close()

"""``kv_transfer_params`` checked field by field, and refused by a server without a KV role."""

from __future__ import annotations

import httpx
import pytest

from infer_lab.serve.disagg import KVRoleConfig, parse_kv_params
from infer_lab.serve.errors import APIError
from infer_lab.serve.kv_args import add_kv_arguments
from infer_lab.serve.server import make_app
from tests.live_server import running

GOOD = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
        "remote_request_id": "cmpl-1", "remote_block_ids": [4, 0, 9], "remote_host": "127.0.0.1",
        "remote_port": 5000, "tp_size": 1}


def test_vllms_shapes_parse():
    p = parse_kv_params(GOOD)
    assert p.remote_prefill and not p.remote_decode
    assert (p.host, p.port, p.request_id, p.block_ids) == ("127.0.0.1", 5000, "cmpl-1", [4, 0, 9])
    first = parse_kv_params({"do_remote_decode": True, "do_remote_prefill": False,
                             "remote_engine_id": None, "remote_block_ids": None,
                             "remote_host": None, "remote_port": None})
    assert first.remote_decode and not first.remote_prefill


@pytest.mark.parametrize("bad", [
    [], "x", {"do_remote_prefill": "yes"}, {"do_remote_prefill": True, "do_remote_decode": True},
    {**GOOD, "remote_host": ""}, {**GOOD, "remote_host": 5}, {**GOOD, "remote_port": 0},
    {**GOOD, "remote_port": 70000}, {**GOOD, "remote_port": True}, {**GOOD, "remote_port": 1.5},
    {**GOOD, "remote_request_id": ""}, {**GOOD, "remote_request_id": None},
    {**GOOD, "remote_block_ids": None}, {**GOOD, "remote_block_ids": [-1]},
    {**GOOD, "remote_block_ids": [1.0]}, {**GOOD, "remote_block_ids": [True]},
    {**GOOD, "remote_block_ids": list(range(70000))}, {**GOOD, "tp_size": 2},
    {**GOOD, "remote_engine_id": 3},
])
def test_malformed_params_are_a_400(bad):
    with pytest.raises(APIError) as e:
        parse_kv_params(bad)
    assert e.value.status == 400 and "kv_transfer_params" in str(e.value.body)


def test_a_role_needs_a_token_and_a_known_role():
    with pytest.raises(ValueError, match="token"):
        KVRoleConfig("prefill", "")
    with pytest.raises(ValueError, match="kv-role"):
        KVRoleConfig("producer", "t")
    with pytest.raises(ValueError, match="--kv-max-pinned-blocks must be 0 or more, got -1"):
        KVRoleConfig("prefill", "t", max_pinned_blocks=-1)
    for bad in ({"pin_timeout_s": 0.0}, {"pull_timeout_s": -1.0}, {"pull_timeout_s": float("nan")}):
        with pytest.raises(ValueError, match="must be positive"):
            KVRoleConfig("decode", "t", **bad)


def test_the_flags_parse():
    import argparse

    parser = argparse.ArgumentParser()
    add_kv_arguments(parser)
    args = parser.parse_args(["--kv-role", "decode", "--kv-peers", "127.0.0.1:5,[::1]:6"])
    assert args.kv_role == "decode" and args.kv_transfer_host == "127.0.0.1"
    assert args.kv_max_pinned_blocks is None and args.kv_pull_timeout == 10.0  # the defaults
    args = parser.parse_args(["--kv-max-pinned-blocks", "7", "--kv-pull-timeout", "2.5"])
    assert (args.kv_max_pinned_blocks, args.kv_pull_timeout) == (7, 2.5)


def test_a_server_without_a_kv_role_refuses_the_params():
    app = make_app(None, device="cpu", num_kv_blocks=32, max_num_seqs=4)
    with running(app) as base:
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "prompt": "hello", "max_tokens": 2, "kv_transfer_params": GOOD})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "kv_transfer_params"
        assert "no KV role" in r.json()["error"]["message"]
        ok = httpx.post(f"{base}/v1/completions", timeout=60,
                        json={"prompt": "hello", "max_tokens": 2})
        assert ok.status_code == 200 and "kv_transfer_params" not in ok.json()


def test_the_flags_give_the_engine_a_tier_and_a_role(tmp_path, monkeypatch):
    import argparse

    from infer_lab.serve.disagg import install_kv

    parser = argparse.ArgumentParser()
    add_kv_arguments(parser)
    app = make_app(None, device="cpu", num_kv_blocks=32, max_num_seqs=4)
    install_kv(app, parser.parse_args(["--kv-tier-dir", str(tmp_path)]))
    assert app.state.server.engine.engine.kv.tier is not None
    assert getattr(app.state, "kv_disagg", None) is None  # a tier is not a role
    monkeypatch.delenv("INFER_LAB_KV_TOKEN", raising=False)
    with pytest.raises(ValueError, match="token"):  # a role without a token: refused
        install_kv(app, parser.parse_args(["--kv-role", "prefill"]))
    monkeypatch.setenv("INFER_LAB_KV_TOKEN", "t")
    other = make_app(None, device="cpu", num_kv_blocks=32, max_num_seqs=4)
    install_kv(other, parser.parse_args(["--kv-role", "prefill"]))
    endpoint = other.state.kv_disagg.endpoint
    assert endpoint.host == "127.0.0.1" and endpoint.port > 0  # loopback by default
    other.state.kv_disagg.close()


def test_a_prefill_worker_refuses_a_streamed_first_stage_and_answers_a_whole_one(monkeypatch):
    """vLLM sends ``kv_transfer_params`` only in a non-streaming answer; a streamed first stage
    would lose them (and leave the blocks pinned), so it is a 400 naming the field."""
    import argparse

    from infer_lab.serve.disagg import install_kv

    parser = argparse.ArgumentParser()
    add_kv_arguments(parser)
    monkeypatch.setenv("INFER_LAB_KV_TOKEN", "t")
    app = make_app(None, device="cpu", num_kv_blocks=32, max_num_seqs=4)
    install_kv(app, parser.parse_args(["--kv-role", "prefill"]))
    first = {"prompt": "In the beginning God created the heaven and the earth.",
             "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    try:
        with running(app) as base:
            r = httpx.post(f"{base}/v1/completions", timeout=60, json={**first, "stream": True})
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
            assert "cannot stream" in r.json()["error"]["message"]
            ok = httpx.post(f"{base}/v1/completions", timeout=60, json=first)
            assert ok.status_code == 200
            params = ok.json()["kv_transfer_params"]
            prompt_tokens = ok.json()["usage"]["prompt_tokens"]
            assert len(params["remote_block_ids"]) == -(-(prompt_tokens - 1) // 16)
    finally:
        app.state.kv_disagg.close()


@pytest.mark.parametrize("flags", [["--kv-role", "prefill"], ["--kv-role", "decode"],
                                   ["--kv-tier-dir", "/nonexistent/tier"]])
def test_serve_refuses_kv_flags_with_tensor_parallelism_before_loading(flags, capsys,
                                                                        monkeypatch):
    """Each rank holds its own KV heads: the tier and the transfer would move rank 0's only.
    A startup error that names the flag, before any model loads or worker process starts."""
    from infer_lab import cli

    def no_load(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("infer_lab.serve.server.make_app", no_load)
    monkeypatch.setenv("INFER_LAB_KV_TOKEN", "t")
    assert cli.main(["serve", "--device", "cpu", "--tensor-parallel-size", "2", *flags]) == 1
    err = capsys.readouterr().err
    assert f"infer-lab: error: {flags[0]} is not supported with --tensor-parallel-size 2" in err
    assert "only rank 0's would be moved" in err

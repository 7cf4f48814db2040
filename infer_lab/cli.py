"""The ``infer-lab`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _threads(args: argparse.Namespace) -> None:
    """``--threads``: torch's intra-op threads (the matmuls' OpenMP team), set before loading."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)


def _generate(args: argparse.Namespace) -> int:
    from infer_lab.engine import EngineConfig, LLMEngine, SamplingParams
    from infer_lab.model.loader import load

    _threads(args)
    model, tok = load(args.model, device=args.device, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1))
    engine.add_request("cli", args.prompt, params)
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    while engine.has_unfinished_requests():
        for request in engine.step():
            out.write(request.outputs[0].delta_text)
            out.flush()
    out.write("\n")
    return 0


def _json_object(text: str) -> dict:
    """A JSON object from the command line (argparse turns the ValueError into a usage error)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _serve(args: argparse.Namespace) -> int:
    from infer_lab import settings
    from infer_lab.engine.config import EngineConfig
    from infer_lab.serve.disagg import install_kv
    from infer_lab.serve.kv_args import check_kv_arguments
    from infer_lab.serve.limits import ServerLimits
    from infer_lab.serve.server import make_app, serve
    from infer_lab.serve.template import load_chat_template

    # checked before the model loads: KV flags the engine cannot honour (tensor parallelism) and
    # a template that does not parse are startup errors
    check_kv_arguments(args)
    chat_template = load_chat_template(args.chat_template) if args.chat_template else None
    _threads(args)
    quantization = _serving_quantization(args)
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len, policy=args.policy,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=quantization, kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=args.speculative_config,
    )
    app = make_app(
        args.model, config=config, served_model_name=args.served_model_name,
        device=args.device, dtype=args.dtype,
        api_key=args.api_key or settings.API_KEY.get(),
        api_key_all_routes=args.api_key_all_routes, max_body_bytes=args.max_body_bytes,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_tokens=args.max_waiting_tokens, vllm_metric_names=args.vllm_metric_names,
        limits=ServerLimits.from_namespace(args), chat_template=chat_template,
        tool_call_parser=args.tool_call_parser,
    )
    install_kv(app, args)  # Chapter 13: a KV role, a KV tier
    print(f"infer-lab: serving on http://{args.host}:{args.port}/v1 (Ctrl-C to stop)",
          file=sys.stderr, flush=True)
    serve(app, args.host, args.port, grace=args.shutdown_grace,
          limit_concurrency=args.limit_concurrency, timeout_keep_alive=args.timeout_keep_alive)
    print("infer-lab: stopped", file=sys.stderr)
    return 0


def _serving_quantization(args: argparse.Namespace) -> str | None:
    """``--quantization``; unset (and no ``--dtype``), a GGUF file served on a CPU keeps its own
    blocks, the fastest path on a CPU (``loader.cpu_serving_quantization``); ``none``: dense."""
    if args.quantization == "none":
        return None
    if args.quantization is not None or args.dtype is not None or args.tensor_parallel_size > 1:
        return args.quantization
    from infer_lab.model.loader import cpu_serving_quantization

    chosen = cpu_serving_quantization(args.model, args.device)
    if chosen is not None:
        print("infer-lab: a GGUF file on a CPU: serving its own blocks (--quantization gguf); "
              "--dtype float32 serves the exact dense model", file=sys.stderr, flush=True)
    return chosen


def _add_request_limits(group: argparse._ArgumentGroup) -> None:
    """The fields of ``infer_lab.serve.limits.ServerLimits`` (the same names and defaults; a
    test checks they agree; importing it here would load the server stack for every command)."""
    for flag, kind, default, text in (
        ("--max-n", int, 8, "most parallel samples (n, best_of) per request; each holds a batch "
         "slot"),
        ("--max-inflight-tokens", int, 0, "admission budget: tokens the requests in flight may "
         "occupy, each n x (prompt + max_tokens); beyond: 429 (0: twice the KV cache's tokens)"),
        ("--max-logprobs-per-request", int, 1 << 18, "n x max_tokens x (1 + top_logprobs) at "
         "most (one answer filling an 8k context with 20 alternatives per token fits)"),
        ("--send-timeout", float, 10.0, "seconds a send may wait on a client that does not "
         "read; then the request is aborted and the connection closed"),
        ("--send-buffer-bytes", int, 0, "each connection's socket send buffer: what a client "
         "that does not read can park in the kernel (0: the OS's, up to MBs)"),
        ("--max-schema-bytes", int, 64 * 1024, "bytes of a JSON schema, regex or grammar"),
        ("--max-schema-depth", int, 64, "JSON nesting of a schema"),
        ("--max-enum-values", int, 1000, "enum values in a schema, or choice strings"),
        ("--grammar-cache-bytes", int, 256 << 20, "bytes of compiled grammars kept for reuse"),
        ("--max-compiles", int, 4, "grammar compilations running or queued (one thread); "
         "beyond: 429"),
        ("--grammar-token-ms", float, 50.0, "CPU ms the grammar matcher may take for one "
         "token; a request over it fails alone"),
        ("--template-timeout", float, 5.0, "seconds the chat template may take to render one "
         "conversation (in a child process; its output counts against the prompt limit)"),
    ):
        group.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer-lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a continuation of a prompt to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="a named model (smollm2-135m-instruct, "
                     "fetched once), a .gguf file or a directory holding one, a checkpoint "
                     "directory or hub id (default: the bundled model)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if any)")
    gen.add_argument("--dtype", default=None, help="fp32, bf16, fp16 (default: by device)")
    gen.add_argument("--threads", type=int, default=None,
                     help="CPU threads for the matmuls (torch.set_num_threads; default: torch's)")
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    srv.add_argument("--model", default=None, help="a named model (smollm2-135m-instruct, "
                     "fetched once), a .gguf file or a directory holding one, a checkpoint "
                     "directory or hub id (default: the bundled model)")
    srv.add_argument("--served-model-name", default=None, help="the name clients ask for")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if any)")
    srv.add_argument("--dtype", default=None, help="fp32, bf16, fp16 (default: by device)")
    srv.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                     help="a jinja chat template (a file, or the template itself) used for every "
                     "request instead of the model's; checked at startup. If it reads 'tools', "
                     "a request's tools are passed to it; else the server's default tool prompt "
                     "describes them")
    srv.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral"],
                     default="hermes", help="the format of tool calls the model writes when "
                     "tool_choice is 'auto' (vLLM's names): hermes '<tool_call>{json}</tool_call>'"
                     ", llama3_json '{\"name\": ..., \"parameters\": ...}', mistral "
                     "'[TOOL_CALLS] [...]'; the grammar allows only valid calls of offered tools "
                     "(default: hermes)")
    srv.add_argument("--max-num-seqs", type=int, default=64, help="most running sequences")
    srv.add_argument("--max-num-batched-tokens", type=int, default=2048,
                     help="token budget of one step (prefill chunks + decodes)")
    srv.add_argument("--max-model-len", type=int, default=None)
    kv = srv.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, default=None)
    kv.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    # spelled out so that -h imports no torch; tests/test_cli.py checks them against the package
    srv.add_argument("--policy", choices=["continuous", "static"], default="continuous")
    srv.add_argument("--quantization", choices=["int8", "int4", "gguf", "gptq", "awq", "none"],
                     default=None,
                     help="weights in int8, int4 (groups of 32), a GGUF file's own blocks, a "
                     "GPTQ/AWQ checkpoint's int4 (read as such whenever its config says so), or "
                     "none (dense); default: a GGUF file on a CPU keeps its blocks unless "
                     "--dtype is given, anything else is dense")
    srv.add_argument("--threads", type=int, default=None,
                     help="CPU threads for the matmuls (torch.set_num_threads; default: torch's)")
    srv.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8_e4m3", "fp8_e4m3_scaled"],
                     default="auto",
                     help="KV cache storage: the model's dtype, or 8 bits (about 2x the tokens)")
    srv.add_argument("--no-prefix-caching", action="store_true")
    srv.add_argument("--no-chunked-prefill", action="store_true")
    srv.add_argument("--speculative-config", type=_json_object, default=None,
                     help='speculative decoding, e.g. \'{"method": "ngram", '
                          '"num_speculative_tokens": 4}\' (vLLM\'s names; Chapter 9)')
    srv.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="split the model over N processes (torch.distributed; gloo on CPU)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' (or set INFER_LAB_API_KEY)")
    srv.add_argument("--api-key-all-routes", action="store_true",
                     help="with --api-key, also guard /metrics and the docs (/health stays open)")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20)
    srv.add_argument("--max-waiting-requests", type=int, default=256,
                     help="admitted requests waiting for their first token; beyond: 429")
    srv.add_argument("--max-waiting-tokens", type=int, default=1 << 18,
                     help="tokens the waiting requests may occupy, each n x (prompt + "
                     "max_tokens); beyond: 429")
    srv.add_argument("--limit-concurrency", type=int, default=1024,
                     help="requests in progress at most; beyond: a JSON 503 with Retry-After")
    srv.add_argument("--timeout-keep-alive", type=int, default=5,
                     help="seconds an idle keep-alive connection is kept")
    srv.add_argument("--shutdown-grace", type=float, default=10.0,
                     help="seconds in-flight requests may finish after SIGTERM/SIGINT")
    srv.add_argument("--vllm-metric-names", action="store_true",
                     help="also export the router gauges under vLLM's names (vllm:...)")
    _add_request_limits(srv.add_argument_group(
        "request limits", "what one request may cost (each refusal is counted in /metrics)"))
    from infer_lab.serve.kv_args import add_kv_arguments

    add_kv_arguments(srv)  # Chapter 13
    srv.set_defaults(func=_serve)

    from infer_lab.measure.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_tokens", 1) < 1:
        print("infer-lab: error: --max-tokens must be at least 1", file=sys.stderr)
        return 2
    if getattr(args, "temperature", 0.0) < 0:
        print("infer-lab: error: --temperature must be >= 0", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        print(f"infer-lab: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())

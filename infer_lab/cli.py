"""The ``infer-lab`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _generate(args: argparse.Namespace) -> int:
    from infer_lab.model.generate import encode_prompt, stop_token_ids, stream_naive
    from infer_lab.model.loader import load

    model, tok = load(args.model, device=args.device, dtype=args.dtype)
    prompt_ids = encode_prompt(tok, args.prompt, model.config.max_position_embeddings)
    stops = stop_token_ids(model, tok)
    detok = tok.detokenizer(prompt_ids)
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    for token in stream_naive(
        model, prompt_ids, args.max_tokens, stops, args.temperature, args.seed
    ):
        out.write(detok.add(token))
        out.flush()
    out.write(detok.flush() + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer-lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a continuation of a prompt to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="checkpoint directory or hub id "
                     "(default: the bundled model)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if any)")
    gen.add_argument("--dtype", default=None, help="fp32, bf16, fp16 (default: by device)")
    gen.set_defaults(func=_generate)
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

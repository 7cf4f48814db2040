"""``infer-lab serve``'s flags for Chapter 13 (a KV role, a KV tier), apart from the server
so that building the command line imports no FastAPI."""

from __future__ import annotations

import argparse

TOKEN_ENV = "INFER_LAB_KV_TOKEN"


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    """``infer-lab serve``'s flags for a KV role and a KV tier."""
    g = parser.add_argument_group("KV transfer and tiers (Chapter 13)")
    g.add_argument("--kv-role", choices=["prefill", "decode", "both"], default=None,
                   help=f"take part in prefill/decode disaggregation (token in ${TOKEN_ENV})")
    g.add_argument("--kv-transfer-host", default="127.0.0.1",
                   help="where the KV transfer endpoint binds (default: loopback)")
    g.add_argument("--kv-transfer-port", type=int, default=0, help="0: any free port")
    g.add_argument("--kv-peers", default="",
                   help="host:port,... of the transfer endpoints a decode worker may pull from")
    g.add_argument("--kv-allow", default="127.0.0.1,::1",
                   help="addresses allowed to connect to this worker's transfer endpoint")
    g.add_argument("--kv-pin-timeout", type=float, default=30.0,
                   help="seconds a prefill worker holds blocks nobody pulled")
    g.add_argument("--kv-max-pinned-blocks", type=int, default=None,
                   help="most blocks a prefill worker holds for decode workers at once, so that "
                        "abandoned transfers cannot exhaust its pool (default: half the pool)")
    g.add_argument("--kv-pull-timeout", type=float, default=10.0,
                   help="seconds a decode worker waits on a prefill worker's transfer endpoint "
                        "before it gives up (then --kv-on-failure)")
    g.add_argument("--kv-on-failure", choices=["recompute", "error"], default="recompute",
                   help="what a decode worker does when a pull fails: compute the prompt "
                        "itself, or answer 502")
    g.add_argument("--kv-tier-dir", default=None, help="a second KV tier: files in this folder")
    g.add_argument("--kv-tier-bytes", type=int, default=1 << 30,
                   help="the KV tier's bound in bytes (default 1 GiB)")


def check_kv_arguments(args: argparse.Namespace) -> None:
    """Refuse, before any model loads, what the KV flags cannot do: move the K/V of an engine
    with tensor-parallel ranks (each rank holds its own KV heads of every block in its own
    process; the tier and the transfer read and write rank 0's only)."""
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp > 1 and (args.kv_role is not None or args.kv_tier_dir):
        flag = "--kv-role" if args.kv_role is not None else "--kv-tier-dir"
        raise ValueError(f"{flag} is not supported with --tensor-parallel-size {tp}: each rank "
                         "holds its own KV heads of every block, and only rank 0's would be "
                         "moved")

"""Train the small mixture-of-experts model that ships with ``infer_lab`` (``assets/tiny-moe``).

The same corpus, split and tokenizer as the dense bundled model (``tiny-kjv``, made by
``scripts/train_bundled_model.py``, whose data helpers this script imports): the King James Bible
from Debian's ``bible-kjv-text`` (or ``--corpus``), one chapter per document, the same 2% of
chapters held out with the same seed, and ``tiny-kjv``'s byte-level BPE tokenizer and chat template
copied as they are. Only the model differs: a Mixtral-architecture transformer
(``MixtralForCausalLM``) whose every MLP is 8 experts of which the router picks 2 per token.
The held-out chapters are written beside the model as ``heldout.txt`` (real text it never saw).

It exists so that Chapter 12's routing statistics (tokens per expert, distinct experts per batch)
come from a router that learned something, not from random weights. The loss is the next-token
cross-entropy plus Switch Transformer's load-balancing loss (``router_aux_loss_coef`` times
transformers' ``load_balancing_loss_func``), meant to keep training from collapsing onto a few
experts (in 25 minutes it did not make the load even: the model card shows the busiest expert of
each layer at 1.6-3.2 times its share).

The run is seeded, CPU only, fp32 PyTorch (AdamW, warmup + cosine), and stops when its wall budget
(``--minutes``) is spent. One thread by default: on a machine shared with other jobs, a second
torch thread made each step several times slower (measured), not faster. The weights are saved
in bf16 (to stay under 5 MB) and the validation loss reported is that of the saved, rounded
weights. Not part of CI.

    python scripts/train_moe.py --minutes 25
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_bundled_model as dense  # noqa: E402  (the dense model's data helpers)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "infer_lab" / "assets" / "tiny-moe"
TOKENIZER_DIR = REPO_ROOT / "infer_lab" / "assets" / "tiny-kjv"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MODEL_KEYS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
    "router_aux_loss_coef", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
    "tie_word_embeddings",
]  # fmt: skip


def load_tokenizer() -> tuple[object, dict[str, int]]:
    """tiny-kjv's tokenizer (the `tokenizers` object) and its special-token ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in dense.SPECIAL_TOKENS}
    if None in ids.values():
        raise SystemExit(f"{TOKENIZER_DIR} lacks a special token: {ids}")
    return tok, ids


@torch.no_grad()
def evaluate(model: MixtralForCausalLM, stream: torch.Tensor, seq_len: int) -> float:
    """Mean next-token cross-entropy (nats) over the stream in non-overlapping windows."""
    was_training = model.training
    model.eval()
    n_win = (len(stream) - 1) // seq_len
    x = stream[: n_win * seq_len].view(n_win, seq_len)
    y = stream[1 : n_win * seq_len + 1].view(n_win, seq_len)
    total = 0.0
    for i in range(0, n_win, 32):
        logits = model(input_ids=x[i : i + 32]).logits
        total += F.cross_entropy(logits.flatten(0, 1), y[i : i + 32].flatten(),
                                 reduction="sum").item()
    model.train(was_training)
    return total / y.numel()


@torch.no_grad()
def expert_load(model: MixtralForCausalLM, stream: torch.Tensor, seq_len: int) -> list[list[int]]:
    """Tokens routed to each expert of each layer over the validation stream (top-k counts)."""
    model.eval()
    n_win = (len(stream) - 1) // seq_len
    x = stream[: n_win * seq_len].view(n_win, seq_len)
    cfg = model.config
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_local_experts, dtype=torch.long)
    for i in range(0, n_win, 32):
        out = model(input_ids=x[i : i + 32], output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            top = logits.topk(cfg.num_experts_per_tok, dim=-1).indices.flatten()
            counts[layer] += torch.bincount(top, minlength=cfg.num_local_experts)
    return counts.tolist()


def write_heldout(out: Path, chapters: list) -> None:
    """The held-out chapters as plain text (``heldout.txt``): real text the model never trained
    on, for Chapter 12's routing statistics. One chapter per paragraph, verses one per line."""
    text = "\n\n".join(f"{c.book} {c.number}\n" + c.text for c in chapters)
    (out / "heldout.txt").write_text(text + "\n", encoding="utf-8")


def write_model_card(out: Path, log: dict) -> None:
    c = log["config"]
    load = log["validation_expert_load"]
    rows = "\n".join(
        f"| {i} | {' '.join(f'{n / sum(r):.1%}' for n in r)} | {max(r) / (sum(r) / len(r)):.2f} |"
        for i, r in enumerate(load))
    card = f"""# tiny-moe

A mixture-of-experts model trained from scratch on the King James Bible, for Chapter 12 of
`infer_lab`: {log["params"] / 1e6:.2f} M parameters, of which {log["active_params"] / 1e6:.2f} M
are used for each token. Every layer's MLP is {c["num_local_experts"]} experts and a router picks
{c["num_experts_per_tok"]} of them per token (`MixtralForCausalLM`, `model_type: "mixtral"`).
It continues scripture-like text; it knows nothing and follows no instructions.

Load it with `il.load("tiny-moe")`, serve it with `infer-lab serve --model tiny-moe` (or
`make serve MODEL=tiny-moe`); `transformers` loads the same directory. `heldout.txt` holds the
{log["data"]["val_chapters"]} held-out chapters as plain text (real text the model never trained on,
for routing statistics).

## Data and tokenizer

Exactly those of `tiny-kjv` ({log["corpus"]}): {log["data"]["chapters"]} chapters, one document
each, {log["data"]["val_chapters"]} held out (seed {log["seed"]}), about
{log["data"]["chat_frac"]:.0%} of the training tokens synthetic chat samples. The tokenizer
files are copied from `tiny-kjv` unchanged (vocabulary {c["vocab_size"]}, the same chat template).

## Architecture

Hidden size {c["hidden_size"]}, {c["num_hidden_layers"]} layers, {c["num_attention_heads"]} query
heads and {c["num_key_value_heads"]} KV heads (head dim {c["head_dim"]}); in every layer
{c["num_local_experts"]} SwiGLU experts of intermediate size {c["intermediate_size"]}, top-
{c["num_experts_per_tok"]} routing with the chosen weights renormalised (Mixtral's rule); tied
embeddings; RoPE theta {c["rope_parameters"]["rope_theta"]:g}; `max_position_embeddings`
{c["max_position_embeddings"]} (trained on {log["seq_len"]}-token windows). Parameters:
{log["params"]:,} in all, {log["active_params"]:,} active per token. Weights saved in bf16.

## Training

fp32 PyTorch on CPU ({log["threads"]} thread(s), {log["machine"]}, on a machine shared with other
jobs, so that far fewer steps fit in the budget than on an idle one):
AdamW (betas 0.9/0.95, weight decay {log["weight_decay"]}), peak LR {log["lr"]},
{log["warmup"]} warmup steps, cosine decay, batch {log["batch_size"]} x {log["seq_len"]} tokens,
loss = cross-entropy + {c["router_aux_loss_coef"]} x load-balancing loss, seed {log["seed"]}.
{log["steps"]} steps ({log["train_tokens_seen"]:,} tokens, {log["epochs"]:.2f} epochs) in
{log["train_minutes"]:.1f} minutes of training ({log["wall_minutes"]:.1f} minutes wall in all).

| split | cross-entropy (nats/token), bf16 weights | perplexity |
| --- | --- | --- |
| validation ({log["val_tokens"]:,} tokens) | {log["val_loss"]:.4f} | {log["val_ppl"]:.2f} |

(The fp32 weights before rounding: {log["val_loss_fp32"]:.4f}.) For comparison, the dense
`tiny-kjv` (3.74 M parameters, all active, 25 minutes) reached 3.17.

Share of the validation tokens' top-{c["num_experts_per_tok"]} choices that went to each expert,
per layer, and the busiest expert's load over the mean (1.00 = perfectly balanced):

| layer | experts 0..{c["num_local_experts"] - 1} | max / mean |
| --- | --- | --- |
{rows}

Greedy continuations of 40 tokens (transformers `generate(do_sample=False)`; prompt `|`
continuation):

```text
{chr(10).join(f"{p}|{t}" + chr(10) for p, t in log["samples"].items())}```

## Retrain

```bash
apt-get install bible-kjv-text
{log["command"]}
```

The run stops on its wall-time budget, so the step count (and the weights) depend on the machine.
"""
    (out / "README.md").write_text(card)


def active_parameters(cfg: MixtralConfig, total: int) -> int:
    """Parameters one token uses: all but the experts it is not routed to."""
    per_expert = 3 * cfg.hidden_size * cfg.intermediate_size
    unused = cfg.num_local_experts - cfg.num_experts_per_tok
    return total - cfg.num_hidden_layers * unused * per_expert


def main() -> None:  # noqa: PLR0915 (a training script reads best top to bottom)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--corpus", type=Path, default=None, help="one verse per line, `Ge1:1 text`")
    p.add_argument("--minutes", type=float, default=25.0, help="wall budget for training")
    p.add_argument("--steps", type=int, default=None, help="fix the schedule to N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-intermediate", type=int, default=128)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--val-frac", type=float, default=0.02)
    p.add_argument("--chat-frac", type=float, default=0.04, help="share of training tokens")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--heldout-only", action="store_true",
                   help="only (re)write heldout.txt into --out, no training")
    args = p.parse_args()

    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    # The dense script's data pipeline, step for step, so the split is the same.
    raw, corpus_desc = dense.read_corpus(args.corpus)
    chapters = dense.parse_chapters(raw)
    order = list(range(len(chapters)))
    rng.shuffle(order)
    n_val = max(1, round(args.val_frac * len(chapters)))
    val_idx = set(order[:n_val])
    train_ch = [c for i, c in enumerate(chapters) if i not in val_idx]
    val_ch = [c for i, c in enumerate(chapters) if i in val_idx]
    if args.heldout_only:
        write_heldout(args.out, val_ch)
        return
    tok, special_ids = load_tokenizer()
    eos_id = special_ids[dense.EOS]
    book_stream = dense.encode_stream(tok, [c.text for c in train_ch], eos_id)
    chat_docs = dense.chat_samples(train_ch, 64, rng)
    per_chat = len(dense.encode_stream(tok, chat_docs, eos_id)) / len(chat_docs)
    n_chat = int(args.chat_frac / (1 - args.chat_frac) * len(book_stream) / per_chat)
    train_docs = [c.text for c in train_ch] + dense.chat_samples(train_ch, n_chat, rng)
    rng.shuffle(train_docs)
    train_stream = dense.encode_stream(tok, train_docs, eos_id)
    val_stream = dense.encode_stream(tok, [c.text for c in val_ch], eos_id)
    chat_frac = 1 - len(book_stream) / len(train_stream)
    print(f"corpus: {len(chapters)} chapters ({len(val_ch)} held out); train tokens "
          f"{len(train_stream):,}, val tokens {len(val_stream):,}", flush=True)

    config = MixtralConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=args.hidden,
        intermediate_size=args.expert_intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, hidden_act="silu", max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True, num_local_experts=args.experts,
        num_experts_per_tok=args.top_k, router_aux_loss_coef=args.aux_coef,
        output_router_logits=False, sliding_window=None, bos_token_id=eos_id,
        eos_token_id=eos_id, pad_token_id=eos_id, initializer_range=0.02,
    )
    model = MixtralForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    n_active = active_parameters(config, n_params)
    print(f"model: {n_params:,} parameters, {n_active:,} active per token", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    gen = torch.Generator().manual_seed(args.seed)
    budget = args.minutes * 60.0
    t_train = time.time()
    step, smooth = 0, None
    model.train()
    while True:
        elapsed = time.time() - t_train
        if (args.steps is not None and step >= args.steps) or elapsed >= budget:
            break
        progress = step / args.steps if args.steps is not None else elapsed / budget
        lr = dense.lr_at(step, progress, args.lr, args.warmup, floor=0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        hi = len(train_stream) - args.seq_len - 1
        starts = torch.randint(0, hi, (args.batch_size,), generator=gen)
        chunk = torch.stack([train_stream[s : s + args.seq_len + 1] for s in starts.tolist()])
        out = model(input_ids=chunk[:, :-1], output_router_logits=True)
        ce = F.cross_entropy(out.logits.flatten(0, 1), chunk[:, 1:].flatten())
        loss = ce + args.aux_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        smooth = ce.item() if smooth is None else 0.95 * smooth + 0.05 * ce.item()
        if step % args.log_every == 0 or step == 1:
            print(f"step {step:5d}  ce {ce.item():.3f} (ema {smooth:.3f})  aux "
                  f"{out.aux_loss.item():.3f}  lr {lr:.2e}  {time.time() - t_train:6.0f}s",
                  flush=True)
        if step % args.eval_every == 0:
            print(f"step {step:5d}  val loss {evaluate(model, val_stream, args.seq_len):.4f}",
                  flush=True)
    train_seconds = time.time() - t_train

    val_fp32 = evaluate(model, val_stream, args.seq_len)
    model = model.to(torch.bfloat16).float()  # what the saved bf16 file holds, exactly
    val_loss = evaluate(model, val_stream, args.seq_len)
    print(f"validation loss {val_loss:.4f} nats (fp32 before rounding {val_fp32:.4f})",
          flush=True)
    load = expert_load(model, val_stream, args.seq_len)

    out_dir: Path = args.out
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.float()
    GenerationConfig(bos_token_id=eos_id, eos_token_id=[eos_id, special_ids[dense.END]],
                     pad_token_id=eos_id, do_sample=False).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, out_dir / name)
    write_heldout(out_dir, val_ch)
    model_config = json.loads((out_dir / "config.json").read_text())
    model_config["rope_theta"] = model_config["rope_parameters"]["rope_theta"]  # the hub's key
    (out_dir / "config.json").write_text(json.dumps(model_config, indent=2, sort_keys=True) + "\n")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    samples: dict[str, str] = {}
    for prompt in dense.SAMPLE_PROMPTS:
        enc = hf_tok(prompt, return_tensors="pt")
        with torch.no_grad():
            ids = reloaded.generate(**enc, do_sample=False, max_new_tokens=40)
        samples[prompt] = hf_tok.decode(ids[0, enc["input_ids"].shape[1] :])
        print(f"{prompt!r} -> {samples[prompt]!r}", flush=True)

    log = {
        "corpus": corpus_desc,
        "seed": args.seed,
        "command": shlex.join(["python", "scripts/train_moe.py", *sys.argv[1:]]),
        "params": n_params,
        "active_params": n_active,
        "config": {k: v for k, v in model_config.items() if k in MODEL_KEYS},
        "special_token_ids": special_ids,
        "data": {"chapters": len(chapters), "val_chapters": len(val_ch),
                 "train_tokens": len(train_stream), "chat_samples": n_chat,
                 "chat_frac": chat_frac},
        "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr,
        "warmup": args.warmup, "weight_decay": args.weight_decay, "threads": args.threads,
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "steps": step,
        "train_tokens_seen": step * args.batch_size * args.seq_len,
        "epochs": step * args.batch_size * args.seq_len / len(train_stream),
        "train_minutes": train_seconds / 60,
        "val_tokens": (len(val_stream) - 1) // args.seq_len * args.seq_len,
        "val_loss": val_loss,
        "val_loss_fp32": val_fp32,
        "val_ppl": math.exp(val_loss),
        "validation_expert_load": load,
        "samples": samples,
    }
    log["wall_minutes"] = (time.time() - t_start) / 60
    write_model_card(out_dir, log)
    (out_dir / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    for f in out_dir.iterdir():
        f.chmod(0o644)
    sizes = {f.name: f.stat().st_size for f in sorted(out_dir.iterdir())}
    print(f"wrote {out_dir}: {json.dumps(sizes)}; wall {log['wall_minutes']:.1f} min", flush=True)


if __name__ == "__main__":
    main()

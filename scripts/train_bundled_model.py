"""Train the small Llama model that ships with ``infer_lab`` (``infer_lab/assets/tiny-kjv``).

Corpus: the King James Bible (public domain), read from Debian's ``bible-kjv-text`` package
through its ``bible`` program (``apt-get install bible-kjv-text``), or from a text file in the
same one-verse-per-line form (``Ge1:1 In the beginning ...``) given with ``--corpus``.

Each chapter is one document: its verses, without numbers, one per line, then ``<|endoftext|>``.
About 2% of the chapters are held out for validation. A few synthetic chat samples (the user gives
the first half of a verse, the assistant the rest) teach the model the chat-template tokens.

The run is seeded, CPU only, plain fp32 PyTorch (AdamW, warmup + cosine). It stops when its wall
budget (``--minutes``) is spent, so the number of steps depends on the machine; pass ``--steps``
to fix it. Not part of CI.

    python scripts/train_bundled_model.py --minutes 25
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "infer_lab" / "assets" / "tiny-kjv"

EOS = "<|endoftext|>"
USER, ASSISTANT, SYSTEM, END = "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"
SPECIAL_TOKENS = [EOS, USER, ASSISTANT, SYSTEM, END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "Finish the verse.",
    "Answer in the words of the King James Bible.",
]

BOOK_NAMES = {
    "Ge": "Genesis", "Exo": "Exodus", "Lev": "Leviticus", "Num": "Numbers",
    "Deu": "Deuteronomy", "Josh": "Joshua", "Jdgs": "Judges", "Ruth": "Ruth",
    "1Sm": "1 Samuel", "2Sm": "2 Samuel", "1Ki": "1 Kings", "2Ki": "2 Kings",
    "1Chr": "1 Chronicles", "2Chr": "2 Chronicles", "Ezra": "Ezra", "Neh": "Nehemiah",
    "Est": "Esther", "Job": "Job", "Psa": "Psalms", "Prv": "Proverbs",
    "Eccl": "Ecclesiastes", "SSol": "Song of Solomon", "Isa": "Isaiah", "Jer": "Jeremiah",
    "Lam": "Lamentations", "Eze": "Ezekiel", "Dan": "Daniel", "Hos": "Hosea",
    "Joel": "Joel", "Amos": "Amos", "Obad": "Obadiah", "Jonah": "Jonah", "Mic": "Micah",
    "Nahum": "Nahum", "Hab": "Habakkuk", "Zep": "Zephaniah", "Hag": "Haggai",
    "Zec": "Zechariah", "Mal": "Malachi", "Mat": "Matthew", "Mark": "Mark", "Luke": "Luke",
    "John": "John", "Acts": "Acts", "Rom": "Romans", "1Cor": "1 Corinthians",
    "2Cor": "2 Corinthians", "Gal": "Galatians", "Eph": "Ephesians", "Phi": "Philippians",
    "Col": "Colossians", "1Th": "1 Thessalonians", "2Th": "2 Thessalonians",
    "1Tim": "1 Timothy", "2Tim": "2 Timothy", "Titus": "Titus", "Phmn": "Philemon",
    "Heb": "Hebrews", "Jas": "James", "1Pet": "1 Peter", "2Pet": "2 Peter", "1Jn": "1 John",
    "2Jn": "2 John", "3Jn": "3 John", "Jude": "Jude", "Rev": "Revelation",
}  # fmt: skip

SAMPLE_PROMPTS = ["In the beginning", "And the LORD said unto Moses", "Blessed are the"]
MODEL_KEYS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_parameters", "tie_word_embeddings",
]  # fmt: skip
VERSE_RE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


@dataclass
class Chapter:
    """One document: a chapter of one book, as a list of verse texts."""

    book: str
    number: int
    verses: list[str]

    @property
    def text(self) -> str:
        """The chapter as training text: one verse per line, no verse numbers."""
        return "\n".join(self.verses)


def read_corpus(corpus: Path | None) -> tuple[str, str]:
    """Return the raw one-verse-per-line text and a description of where it came from."""
    if corpus is not None:
        return corpus.read_text(encoding="utf-8"), str(corpus)
    if shutil.which("bible") is None:
        raise SystemExit("no `bible` program: apt-get install bible-kjv-text, or pass --corpus")
    # -f turns pretty-printing off: one verse per line with its reference ("Ge1:1 ...").
    raw = subprocess.run(
        ["bible", "-f", "gen1:1-rev22:21"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return raw, "Debian bible-kjv-text (`bible -f gen1:1-rev22:21`)"


def parse_chapters(raw: str) -> list[Chapter]:
    """Split ``Ge1:1 text`` lines into chapters, in canonical order."""
    chapters: list[Chapter] = []
    for line in raw.splitlines():
        m = VERSE_RE.match(line.strip())
        if m is None:
            continue
        book, number, text = BOOK_NAMES.get(m.group(1), m.group(1)), int(m.group(2)), m.group(4)
        if not chapters or chapters[-1].book != book or chapters[-1].number != number:
            chapters.append(Chapter(book, number, []))
        chapters[-1].verses.append(" ".join(text.split()))
    return chapters


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE on the training text; the special tokens get ids 0..4."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def split_verse(verse: str, rng: random.Random) -> tuple[str, str] | None:
    """Cut a verse near its middle, at a clause boundary if there is one near it."""
    words = verse.split(" ")
    if len(words) < 6:
        return None
    mid = len(words) // 2
    cuts = [i for i in range(2, len(words) - 2) if words[i - 1][-1] in ",;:"]
    cut = min(cuts, key=lambda i: abs(i - mid)) if cuts else mid + rng.randint(-1, 1)
    return " ".join(words[:cut]), " ".join(words[cut:])


def chat_samples(chapters: list[Chapter], n: int, rng: random.Random) -> list[str]:
    """Synthetic chat-formatted samples (rendered with the chat template's exact layout)."""
    verses = [v for c in chapters for v in c.verses]
    out: list[str] = []
    while len(out) < n:
        parts = split_verse(rng.choice(verses), rng)
        if parts is None:
            continue
        text = ""
        if rng.random() < 0.2:
            text += f"{SYSTEM}\n{rng.choice(SYSTEM_PROMPTS)}{END}\n"
        text += f"{USER}\n{parts[0]}{END}\n{ASSISTANT}\n{parts[1]}{END}\n"
        out.append(text)
    return out


def encode_stream(tok: Tokenizer, docs: list[str], eos_id: int) -> torch.Tensor:
    """All documents end to end, each followed by EOS, as one 1-D token tensor."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, progress: float, peak: float, warmup: int, floor: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``peak`` to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    cos = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return peak * (floor + (1.0 - floor) * cos)


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int, batch: int) -> float:
    """Mean next-token cross-entropy (nats) over the stream in non-overlapping windows."""
    model.eval()
    n_win = (len(stream) - 1) // seq_len
    x = stream[: n_win * seq_len].view(n_win, seq_len)
    y = stream[1 : n_win * seq_len + 1].view(n_win, seq_len)
    total, count = 0.0, 0
    for i in range(0, n_win, batch):
        logits = model(input_ids=x[i : i + batch]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y[i : i + batch].flatten(), reduction="sum")
        total += loss.item()
        count += y[i : i + batch].numel()
    model.train()
    return total / count


def save_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> PreTrainedTokenizerFast:
    """Save in HF layout with exactly one copy of the chat template (in tokenizer_config.json)."""
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM, END],
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    # transformers 5 writes the extra specials as a list under "extra_special_tokens", which 4.x
    # cannot read; "additional_special_tokens" is read by both.
    extra = cfg.pop("extra_special_tokens", None) or cfg.get("additional_special_tokens")
    cfg["additional_special_tokens"] = extra
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return hf_tok


def write_model_card(out: Path, log: dict) -> None:
    """README.md for the output directory, filled from the training log."""
    c = log["config"]
    s = log["special_token_ids"]
    card = f"""# tiny-kjv

A {log["params"] / 1e6:.2f} M-parameter Llama model trained from scratch on the King James Bible.
It is the default model of `infer_lab`: small enough to run the whole book on a laptop CPU, big
enough to write text that reads like its corpus. It does not know anything and does not follow
instructions; it continues scripture-like text and stops at `<|endoftext|>` (end of a chapter) or
`<|end|>` (end of a chat turn).

## Corpus

The King James Version of the Bible (1611; public domain), as shipped in Debian's
`bible-kjv-text` package and printed by its `bible` program ({log["corpus"]}).
{log["data"]["chapters"]} chapters, each one document: the verses without their numbers, one per
line, followed by `<|endoftext|>`. {log["data"]["val_chapters"]} chapters
({log["data"]["val_frac"]:.0%}, chosen with seed {log["seed"]}) are held out for validation.
About {log["data"]["chat_frac"]:.0%} of the training tokens are synthetic chat samples in the
chat-template format (the user gives the first half of a verse, the assistant the rest) so that
the template's tokens are trained.

## Architecture

`LlamaForCausalLM` (`model_type: "llama"`): hidden size {c["hidden_size"]},
{c["num_hidden_layers"]} layers, {c["num_attention_heads"]} query heads and
{c["num_key_value_heads"]} KV heads (grouped-query attention, head dim {c["head_dim"]}),
SwiGLU MLP with intermediate size {c["intermediate_size"]}, RMSNorm (eps {c["rms_norm_eps"]}),
RoPE (theta {c["rope_theta"]:g}), tied input/output embeddings,
`max_position_embeddings` {c["max_position_embeddings"]}
(trained on {log["seq_len"]}-token windows),
vocabulary {c["vocab_size"]} (byte-level BPE trained on the training chapters with `tokenizers`).
Parameters: {log["params"]:,}. Weights in fp32 (`model.safetensors`).

Special tokens: `<|endoftext|>` = {s[EOS]} (BOS, EOS and padding; no BOS is prepended when
encoding), `<|user|>` = {s[USER]}, `<|assistant|>` = {s[ASSISTANT]}, `<|system|>` = {s[SYSTEM]},
`<|end|>` = {s[END]}. `generation_config.json` stops on both `<|endoftext|>` and `<|end|>`.

Chat template (in `tokenizer_config.json`):

```jinja
{CHAT_TEMPLATE}
```

## Training

Plain PyTorch fp32 on CPU ({log["threads"]} threads, {log["machine"]}): AdamW (betas 0.9/0.95,
weight decay {log["weight_decay"]}), peak LR {log["lr"]}, {log["warmup"]} warmup steps, cosine
decay, batch {log["batch_size"]} x {log["seq_len"]} tokens, seed {log["seed"]}.
{log["steps"]} steps ({log["train_tokens_seen"]:,} tokens, {log["epochs"]:.2f} epochs) in
{log["train_minutes"]:.1f} minutes of training ({log["wall_minutes"]:.1f} minutes wall in all).

| split | mean token cross-entropy (nats) | perplexity |
| --- | --- | --- |
| validation ({log["val_tokens"]:,} tokens) | {log["val_loss"]:.4f} | {log["val_ppl"]:.2f} |

Greedy continuations of 40 tokens (transformers `generate(do_sample=False)`; the prompt, then
`|`, then the continuation):

```text
{chr(10).join(f"{p}|{t}" + chr(10) for p, t in log["samples"].items())}```

## Retrain

```bash
apt-get install bible-kjv-text
{log["command"]}
```

The run stops on its wall-time budget, so the step count (and the weights) depend on the machine;
`--steps N` fixes the schedule.
"""
    (out / "README.md").write_text(card)


def main() -> None:
    """Parse arguments, build data and tokenizer, train, evaluate, save, and show samples."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--corpus", type=Path, default=None, help="one verse per line, `Ge1:1 text`")
    p.add_argument("--minutes", type=float, default=25.0, help="wall budget for training")
    p.add_argument("--steps", type=int, default=None, help="fix the schedule to N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=3072)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--val-frac", type=float, default=0.02)
    p.add_argument("--chat-frac", type=float, default=0.04, help="share of training tokens")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=500, help="steps between validation runs")
    args = p.parse_args()

    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    raw, corpus_desc = read_corpus(args.corpus)
    chapters = parse_chapters(raw)
    order = list(range(len(chapters)))
    rng.shuffle(order)
    n_val = max(1, round(args.val_frac * len(chapters)))
    val_idx = set(order[:n_val])
    train_ch = [c for i, c in enumerate(chapters) if i not in val_idx]
    val_ch = [c for i, c in enumerate(chapters) if i in val_idx]
    print(f"corpus: {corpus_desc}: {len(chapters)} chapters, {len(val_ch)} held out", flush=True)

    tok = train_tokenizer([c.text for c in train_ch], args.vocab_size)
    special_ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    eos_id = special_ids[EOS]
    print(f"tokenizer: vocab {tok.get_vocab_size()}, special ids {special_ids}", flush=True)

    book_stream = encode_stream(tok, [c.text for c in train_ch], eos_id)
    chat_docs = chat_samples(train_ch, 64, rng)
    per_chat = len(encode_stream(tok, chat_docs, eos_id)) / len(chat_docs)
    n_chat = int(args.chat_frac / (1 - args.chat_frac) * len(book_stream) / per_chat)
    train_docs = [c.text for c in train_ch] + chat_samples(train_ch, n_chat, rng)
    rng.shuffle(train_docs)
    train_stream = encode_stream(tok, train_docs, eos_id)
    val_stream = encode_stream(tok, [c.text for c in val_ch], eos_id)
    chat_frac = 1 - len(book_stream) / len(train_stream)
    print(
        f"train tokens {len(train_stream):,} ({n_chat} chat samples, {chat_frac:.1%}), "
        f"val tokens {len(val_stream):,}",
        flush=True,
    )

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )
    model = LlamaForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

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
        lr = lr_at(step, progress, args.lr, args.warmup, floor=0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        hi = len(train_stream) - args.seq_len - 1
        starts = torch.randint(0, hi, (args.batch_size,), generator=gen)
        chunk = torch.stack([train_stream[s : s + args.seq_len + 1] for s in starts.tolist()])
        logits = model(input_ids=chunk[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        if step % args.log_every == 0 or step == 1:
            print(
                f"step {step:5d}  loss {loss.item():.3f}  (ema {smooth:.3f})  lr {lr:.2e}  "
                f"{time.time() - t_train:6.0f}s",
                flush=True,
            )
        if step % args.eval_every == 0:
            print(f"step {step:5d}  val loss {evaluate(model, val_stream, args.seq_len, 32):.4f}")
    train_seconds = time.time() - t_train

    val_loss = evaluate(model, val_stream, args.seq_len, batch=32)
    print(f"validation loss {val_loss:.4f} nats, perplexity {math.exp(val_loss):.2f}", flush=True)

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.float().save_pretrained(out, safe_serialization=True)
    gen_cfg = GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=[eos_id, special_ids[END]],
        pad_token_id=eos_id,
        do_sample=False,
    )
    gen_cfg.save_pretrained(out)
    save_tokenizer(tok, out, max_len=config.max_position_embeddings)
    # transformers 5 writes RoPE as "rope_parameters"; also write the hub's top-level "rope_theta"
    # so that readers of either shape (and transformers 4.x) see the same value.
    model_config = json.loads((out / "config.json").read_text())
    model_config["rope_theta"] = model_config.get("rope_parameters", {}).get("rope_theta", 1e4)
    (out / "config.json").write_text(json.dumps(model_config, indent=2, sort_keys=True) + "\n")

    # Reload both from disk, the way users will, and check them.
    hf_tok = AutoTokenizer.from_pretrained(out)
    raw_tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    probe = ["\n".join(c.verses[:4]) for c in val_ch] + chat_docs[:8] + SAMPLE_PROMPTS
    tok_agree = all(hf_tok(t)["input_ids"] == raw_tok.encode(t).ids for t in probe)
    messages = [{"role": "user", "content": "In the beginning"}]
    chat = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    print(f"tokenizers == transformers ids: {tok_agree}; chat prompt {chat!r}", flush=True)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    samples: dict[str, str] = {}
    for prompt in SAMPLE_PROMPTS:
        enc = hf_tok(prompt, return_tensors="pt")
        with torch.no_grad():
            ids = reloaded.generate(**enc, do_sample=False, max_new_tokens=40)
        samples[prompt] = hf_tok.decode(ids[0, enc["input_ids"].shape[1] :])
        print(f"{prompt!r} -> {samples[prompt]!r}", flush=True)

    log = {
        "corpus": corpus_desc,
        "seed": args.seed,
        "command": shlex.join(["python", "scripts/train_bundled_model.py", *sys.argv[1:]]),
        "params": n_params,
        "config": {k: v for k, v in model_config.items() if k in MODEL_KEYS},
        "special_token_ids": special_ids,
        "data": {
            "chapters": len(chapters),
            "val_chapters": len(val_ch),
            "val_frac": len(val_ch) / len(chapters),
            "train_tokens": len(train_stream),
            "chat_samples": n_chat,
            "chat_frac": chat_frac,
        },
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "threads": args.threads,
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "steps": step,
        "train_tokens_seen": step * args.batch_size * args.seq_len,
        "epochs": step * args.batch_size * args.seq_len / len(train_stream),
        "train_minutes": train_seconds / 60,
        "val_tokens": (len(val_stream) - 1) // args.seq_len * args.seq_len,
        "val_loss": val_loss,
        "val_ppl": math.exp(val_loss),
        "tokenizers_transformers_agree": tok_agree,
        "samples": samples,
    }
    log["wall_minutes"] = (time.time() - t_start) / 60
    write_model_card(out, log)
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes model.safetensors as 0600
    sizes = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    print(f"wrote {out}: {json.dumps(sizes)}", flush=True)
    print(f"wall time {log['wall_minutes']:.1f} min", flush=True)


if __name__ == "__main__":
    main()

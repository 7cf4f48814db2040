"""Train the EAGLE head shipped for SmolLM2-135M-Instruct in under an hour of CPU wall time.

The head goes to ``infer_lab/assets/eagle-smollm2-135m-instruct``.

Bounded in time, CPU only, seeded. Two phases, each with a wall-clock budget:

1. Self-distillation data (``--data-minutes``, default 40): SmolLM2 answers training prompts
   greedily (``--max-tokens`` each, ``--batch`` at a time) in the engine, which hands over the
   feature of every position of every forward as it goes (no second pass). The prompts
   (``benchmarks/eagle_prompts.py``) are written instruction templates filled with verses of
   the King James Bible (public domain; Debian's ``bible-kjv-text``) or with subjects of that
   world, and (``--everyday``, 40 % of draws) everyday requests about modern subjects; none is
   a held-out prompt the benchmark measures on, and no everyday prompt names a held-out subject.
   Whatever is answered when the budget runs out is the data set (the log records how many);
   ``--extend-minutes`` adds to an earlier run's saved answers (``--data-cache``).
2. Training (``--train-minutes``, default 8): EAGLE's loss (feature regression + 0.1 x
   cross-entropy of the target's next token over a draft vocabulary of the most frequent
   tokens) on the answers' tokens, AdamW, bf16 autocast. 5 % of the answers are held out for
   the reported validation, another 5 % (dev) for early stopping: every ``--validate-every``
   steps the head is checked on the dev answers, and it keeps its best check's weights (a
   data set this small is learnt by heart long before the time is up).

Then the head's acceptance per draft depth is measured on a few validation prompts through the
engine (a chain of ``--depth`` tokens), and the head (bf16 safetensors, under 10 MB), its
training log and a README with this command are written to ``--out``. The whole run takes about
``data + train + 3`` minutes of wall time; how much data and how many steps fit depends on the
machine (the README beside the shipped head says what they were). Not part of CI (the tests
train a tiny head on the bundled model in seconds).

    apt-get install bible-kjv-text
    python scripts/train_eagle.py [--data-minutes 40] [--train-minutes 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # benchmarks/ (the prompts), when run as a script

import infer_lab as il  # noqa: E402
from benchmarks.eagle_prompts import HELD_OUT, training_prompts  # noqa: E402
from infer_lab.engine import LLMEngine, SamplingParams  # noqa: E402
from infer_lab.engine.eagle_train import (  # noqa: E402
    Sample,
    _pad,
    collect_features,
    common_prefix,
    eagle_loss,
    new_head,
    train_eagle_head,
)
from infer_lab.model.eagle_head import save_eagle_head  # noqa: E402

TARGET = "smollm2-135m-instruct"
DEFAULT_OUT = REPO_ROOT / "infer_lab" / "assets" / "eagle-smollm2-135m-instruct"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def get_data(model, tok, args) -> tuple[list[Sample], dict]:
    """Answers with features: from ``--data-cache`` if it exists, else collected now."""
    cache = Path(args.data_cache)
    old: list[Sample] = []
    sittings: list[dict] = []
    if cache.exists():
        blob = torch.load(cache, weights_only=False)
        old, sittings = blob["samples"], blob["info"].get("sittings", [blob["info"]])
        log(f"data from {cache}: {len(old)} answers")
        if not args.extend_minutes:
            return old, blob["info"]
    minutes = args.extend_minutes if old else args.data_minutes
    prompts = training_prompts(args.num_prompts, seed=args.seed, everyday=args.everyday)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True)
           for p in prompts]
    answered = {tuple(s.token_ids[: s.num_prompt_tokens]) for s in old}
    ids = [i for i in ids if tuple(i) not in answered]  # extending: the prompts not answered
    start = time.perf_counter()
    new = collect_features(model, tok, ids, args.max_tokens,
                           deadline=start + 60 * minutes, max_num_seqs=args.batch, log=log)
    sittings.append({"answers": len(new), "seconds": round(time.perf_counter() - start, 1),
                     "load_average": os.getloadavg(), "argv": sys.argv[1:]})
    samples = old + new
    info = {"prompts_available": len(prompts), "answers": len(samples),
            "seconds": round(sum(x["seconds"] for x in sittings), 1),
            "tokens": sum(len(s.token_ids) for s in samples),
            "answer_tokens": sum(len(s.token_ids) - s.num_prompt_tokens for s in samples),
            "max_tokens": args.max_tokens,
            "load_average": max((x["load_average"] for x in sittings), key=max),
            "sittings": sittings}
    if len(samples) < 8:
        raise SystemExit(f"only {len(samples)} answers in {minutes} minutes: give "
                         "--data-minutes more time")
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"samples": samples, "info": info}, cache)
    log(f"collected {info}")
    return samples, info


@torch.no_grad()
def validation(head, model, samples: list[Sample], skip: int) -> dict:
    """Loss and top-1 agreement on held-out answers (no noise), over the answers' tokens."""
    index = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
    index[head.draft_vocab] = torch.arange(len(head.draft_vocab))
    lm_rows = model.embed_tokens.weight[head.draft_vocab].float()
    head.eval()
    totals, n = {}, 0
    for i in range(0, len(samples), 8):
        batch = _pad(samples[i : i + 8], skip, index, 512)
        _, stats = eagle_loss(head.float(), model.embed_tokens, lm_rows, *batch)
        w = int(batch[4].sum())
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v * w
        n += w
    first = [max(skip, s.num_prompt_tokens - 1) for s in samples]  # the answers' labels
    in_vocab = sum(int((index[torch.tensor(s.labels[f:])] >= 0).sum())
                   for s, f in zip(samples, first))
    labels = sum(len(s.labels) - f for s, f in zip(samples, first))
    return {**{k: round(v / n, 4) for k, v in totals.items()},
            "label_in_draft_vocab": round(in_vocab / labels, 4)}


def depth_acceptance(model, tok, head, prompts: list[list[int]], depth: int,
                     max_tokens: int) -> dict:
    """A chain of ``depth`` through the engine on ``prompts``: the fraction of drafts whose
    first i guesses were all accepted, for i = 1..depth, and the mean accepted length."""
    engine = LLMEngine(model, tok, num_kv_blocks=512, speculative_config={
        "method": "eagle", "model": head, "num_speculative_tokens": depth})
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    c = engine.spec.counts
    per_pos = c.num_accepted_tokens_per_pos + [0] * (depth - len(c.num_accepted_tokens_per_pos))
    return {"drafts": c.num_drafts, "accepted_at_depth": [round(x / c.num_drafts, 4)
                                                          for x in per_pos],
            "mean_accepted_length": round(1 + c.num_accepted_tokens / c.num_drafts, 3)}


def write_readme(out: Path, record: dict) -> None:
    acc = record["acceptance"]
    rows = " | ".join(f"{a:.2f}" for a in acc["accepted_at_depth"])
    n = len(record["data"].get("sittings", [])) or 1
    sittings = "one sitting" if n == 1 else f"{n} sittings (`--extend-minutes`)"
    again = "" if n == 1 else (
        f"\nThat command extended the answers an earlier run had saved (`--data-cache`); in one "
        f"sitting, `--data-minutes {record['data']['seconds'] / 60:.0f}` collects about as "
        f"many.\n")
    (out / "README.md").write_text(f"""# EAGLE head for SmolLM2-135M-Instruct

An EAGLE-style draft head (one decoder layer of SmolLM2's shape over the concatenation of the
target's last feature and the next token's embedding; the target's embedding and LM head are
reused, frozen, and are not in this file) for `smollm2-135m-instruct` (the GGUF of
`infer_lab.model.registry`, loaded in fp32). Use it with

```python
il.LLM("smollm2-135m-instruct", speculative_config={{"method": "eagle",
       "model": "eagle-smollm2-135m-instruct", "num_speculative_tokens": 4}})
```

- `head.safetensors`: bf16 weights ({record["head_bytes"] / 1e6:.1f} MB), the draft vocabulary
  ({record["draft_vocab_size"]} token ids, int32) and the metadata the loader checks against
  the target (hidden size, vocabulary, heads, and `trained_depth`
  {record["trained_depth"]}: the chain length the acceptance below was validated at; training
  itself is one step ahead, teacher-forced).
- `training_log.json`: the run (data, loss curve, validation, acceptance, machine, command).

Trained by self-distillation on CPU: SmolLM2 answered {record["data"]["answers"]} prompts
({record["data"]["answer_tokens"]} answer tokens, {record["data"]["tokens"]} tokens in all) in
{sittings}, {record["data"]["seconds"] / 60:.0f} minutes of generation: instruction templates over
verses of the King James Bible (public domain, Debian's `bible-kjv-text`) and subjects of that
world, and everyday requests about modern subjects, none of them a held-out benchmark prompt or
naming a held-out subject (`benchmarks/eagle_prompts.py`). The loss is on the answers' tokens.
The head then trained for {record["train"]["seconds"] / 60:.0f} minutes
({record["train"]["steps"]} steps), checked every few steps on {record["split"]["dev"]} dev
answers; it keeps the weights of its best check (step {record["train"]["kept_step"]}).
Validation ({record["split"]["validation"]} other held-out answers): top-1 agreement with the
target's next token {record["validation"]["top1"]:.3f}. Through the engine, on
{record["acceptance_prompts"]} validation prompts, a chain of {len(acc["accepted_at_depth"])}:
fraction of drafts with the first i guesses accepted, i = 1.. : {rows}; mean accepted length
{acc["mean_accepted_length"]:.2f}.

Reproduce (how much data and how many steps fit in the minutes depends on the machine):

```bash
{record["command"]}
```
{again}""")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Time-bounded: about data + train + 3 minutes of wall "
                                        "time (defaults: 40 + 8 + 3).")
    ap.add_argument("--data-minutes", type=float, default=40.0,
                    help="wall-clock budget for answering prompts (default 40)")
    ap.add_argument("--train-minutes", type=float, default=8.0,
                    help="wall-clock budget for training (default 8)")
    ap.add_argument("--extend-minutes", type=float, default=0.0,
                    help="with a --data-cache from an earlier run: answer this many more "
                    "minutes of the prompts it did not reach, and keep both (each sitting is "
                    "logged)")
    ap.add_argument("--num-prompts", type=int, default=4000, help="prompts available")
    ap.add_argument("--everyday", type=float, default=0.4,
                    help="fraction of prompts drawn from the everyday templates (default 0.4; "
                    "the rest are KJV prompts)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per answer")
    ap.add_argument("--batch", type=int, default=64, help="answers generated at once")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--depth", type=int, default=8,
                    help="depth to validate the head at, recorded as its trained_depth "
                    "(the engine refuses deeper drafts); training is one step ahead")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--validate-every", type=int, default=100,
                    help="steps between checks on the dev answers; the head keeps the weights "
                    "of its best check (default 100)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-cache", default="/tmp/infer_lab_eagle_data.pt",
                    help="answers and features saved here and reused if present")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tok = il.load(TARGET, device="cpu", dtype=torch.float32)
    samples, data_info = get_data(model, tok, args)
    rng = random.Random(args.seed)
    rng.shuffle(samples)
    n_val = max(4, len(samples) // 20)
    # validation (reported) and dev (early stopping) are different answers, so the reported
    # figure is not the one the weights were chosen by
    val, dev, train = samples[:n_val], samples[n_val : 2 * n_val], samples[2 * n_val :]
    meta = {"target": TARGET, "method": "EAGLE-1 (Li et al. 2024), draft vocabulary as EAGLE-3"}
    head = new_head(model, train, args.draft_vocab, args.depth, args.seed, meta).float()
    skip = common_prefix(train)
    history = train_eagle_head(head, model, train, minutes=args.train_minutes, lr=args.lr,
                               seed=args.seed, log=lambda s: log(json.dumps(s)),
                               validate=lambda: validation(head, model, dev, skip),
                               validate_every=args.validate_every)
    val_stats = validation(head, model, val, skip)
    log(f"validation {val_stats}")
    steps = [h for h in history if "loss" in h]
    checks = [h for h in history if "validation" in h]
    kept = max(checks, key=lambda h: h["validation"]["top1"]) if checks else None
    args.out.mkdir(parents=True, exist_ok=True)
    path = save_eagle_head(head, args.out)
    from infer_lab.model.eagle_head import load_eagle_head

    shipped = load_eagle_head(path, model)  # what the engine will run: the bf16 weights
    acc_prompts = [s.token_ids[: s.num_prompt_tokens] for s in val[:8]]
    acceptance = depth_acceptance(model, tok, shipped, acc_prompts, args.depth, 48)
    log(f"acceptance {acceptance}")
    command = ("apt-get install bible-kjv-text && python scripts/train_eagle.py "
               + shlex.join(argv if argv is not None else sys.argv[1:]))
    record = {
        "target": TARGET, "command": command.strip(), "seed": args.seed,
        "trained_depth": args.depth, "draft_vocab_size": len(head.draft_vocab),
        "head_bytes": path.stat().st_size, "data": data_info,
        "split": {"train": len(train), "validation": len(val), "dev": len(dev),
                  "loss_skips_prefix": skip, "loss_on": "answer tokens"},
        "train": {"steps": len(steps), "seconds": history[-1]["seconds"] if history else 0,
                  "lr": args.lr, "history": steps[::5] + steps[-1:],
                  "dev_checks": checks, "kept_step": kept["step"] if kept else None},
        "validation": val_stats, "acceptance": acceptance, "acceptance_prompts": len(acc_prompts),
        "held_out_prompts": HELD_OUT,
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": args.threads, "load_average_end": os.getloadavg(),
                    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                             capture_output=True, text=True,
                                             cwd=REPO_ROOT).stdout.strip()},
        "wall_minutes": round((time.perf_counter() - t0) / 60, 1),
    }
    (args.out / "training_log.json").write_text(json.dumps(record, indent=1) + "\n")
    write_readme(args.out, record)
    log(f"wrote {args.out} ({record['wall_minutes']} min)")


if __name__ == "__main__":
    main()

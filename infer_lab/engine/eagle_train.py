"""Self-distillation for an EAGLE head: the target's own answers and features, then training.

:func:`collect_features` runs the engine over a list of prompts (greedy, batched) with the
runner's ``hidden_states_hook`` set, so every forward hands over the feature of every position
it computes: the prompt's in the prefill, each new token's in its decode step. No second pass.
It also keeps, per position, the token the target would pick next (its argmax): for the answer
that is the next token itself (greedy), for the prompt it is computed from the feature.

:func:`eagle_loss` is EAGLE's: the head reads (feature of p - 1, token p) and guesses the
feature of p; the loss is a smooth-L1 regression of that guess on the real feature, plus 0.1 x
the cross-entropy of the draft vocabulary's logits against the target's own next token. Input
features get a little uniform noise, so that the head learns to cope with its own errors when a
draft feeds its guesses back in. :func:`train_eagle_head` runs AdamW on it for a step count or
a wall-clock budget (bf16 autocast on a CPU, where it is faster).

``scripts/train_eagle.py`` is the full run; Chapter 9 and the tests train for a few steps.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from infer_lab.engine.engine import LLMEngine
from infer_lab.engine.sampling_params import SamplingParams
from infer_lab.model.eagle_head import EagleHead


@dataclass
class Sample:
    """One prompt and the target's answer: ``token_ids`` (prompt + answer), ``features``
    ``[len - 1, H]`` (float16: position p's, for every position but the last) and ``labels``
    (the target's argmax after each of those positions)."""

    token_ids: list[int]
    features: torch.Tensor
    labels: list[int]
    num_prompt_tokens: int


@torch.inference_mode()
def collect_features(model: Any, tokenizer: Any, prompts: Sequence[list[int]],
                     max_tokens: int, *, deadline: float | None = None,
                     max_num_seqs: int = 32, log: Callable[[str], Any] | None = None
                     ) -> list[Sample]:
    """The target's greedy answers to ``prompts`` with the feature of every position.

    Requests are admitted ``max_num_seqs`` at a time; past ``deadline`` (a ``perf_counter``
    time) no new ones are added, the ones running are aborted, and only finished samples come
    back. Prefix caching is off: a cached prefix would skip the forward that yields features.
    """
    engine = LLMEngine(model, tokenizer, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=4096, enable_prefix_caching=False,
                       num_kv_blocks=max_num_seqs * -(-(max(map(len, prompts)) + max_tokens)
                                                      // 16) + 8)
    weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    feats: dict[str, torch.Tensor] = {}
    labels: dict[str, torch.Tensor] = {}

    def keep(out: Any, batch: Any, hidden: torch.Tensor) -> None:
        r = 0
        for seq, n in zip(out.seqs, out.num_new):
            rid, start = seq.request.request_id, seq.num_computed
            feats[rid][start : start + n] = hidden[r : r + n].to(torch.float16)
            prompt_end = min(start + n, seq.num_prompt_tokens - 1)  # argmax of prompt rows
            if prompt_end > start:
                rows = hidden[r : r + prompt_end - start]
                labels[rid][start:prompt_end] = (rows @ weight.T).argmax(-1)
            r += n

    engine.runner.hidden_states_hook = keep
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    done: list[Sample] = []
    queue = list(enumerate(prompts))
    while queue or engine.has_unfinished_requests():
        late = deadline is not None and time.perf_counter() > deadline
        while queue and not late and len(engine.requests) < max_num_seqs:
            i, ids = queue.pop(0)
            feats[str(i)] = torch.zeros(len(ids) + max_tokens, model.config.hidden_size,
                                        dtype=torch.float16)
            labels[str(i)] = torch.zeros(len(ids) + max_tokens, dtype=torch.long)
            engine.add_request(str(i), ids, params)
        if late:
            for rid in list(engine.requests):
                engine.abort(rid)
            break
        for out in engine.step():
            if out.finished:
                done.append(_sample(out, feats.pop(out.request_id), labels.pop(out.request_id)))
                if log is not None and len(done) % 50 == 0:
                    log(f"{len(done)} answers collected")
    return done


def _sample(out: Any, feats: torch.Tensor, labels: torch.Tensor) -> Sample:
    answer = out.outputs[0].token_ids
    ids = list(out.prompt_token_ids) + list(answer)
    n_prompt = len(out.prompt_token_ids)
    label = labels[: len(ids) - 1].tolist()
    label[n_prompt - 1 :] = answer  # greedy: the next token is the target's argmax
    return Sample(ids, feats[: len(ids) - 1].clone(), label, n_prompt)


def draft_vocabulary(samples: Sequence[Sample], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` tokens the target produced most often (answers and argmax labels), most
    frequent first: the only tokens the head will score and propose."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.labels), minlength=vocab_size)
    return counts.argsort(descending=True, stable=True)[: min(size, vocab_size)]


def common_prefix(samples: Sequence[Sample]) -> int:
    """Tokens every sample starts with (a chat template's system prompt): not worth a loss."""
    first = samples[0].token_ids
    n = min(len(s.token_ids) for s in samples) - 1
    for s in samples[1:]:
        n = next((i for i in range(n) if s.token_ids[i] != first[i]), n)
    return n


def batches(samples: Sequence[Sample], tokens_per_batch: int, rng: random.Random,
            max_len: int = 512) -> list[list[Sample]]:
    """Samples grouped by length (little padding), about ``tokens_per_batch`` tokens each,
    in a random order."""
    order = sorted(samples, key=lambda s: len(s.token_ids))
    groups: list[list[Sample]] = []
    group: list[Sample] = []
    for s in order:
        longest = max([min(len(x.token_ids), max_len) for x in group + [s]])
        if group and longest * (len(group) + 1) > tokens_per_batch:
            groups.append(group)
            group = []
        group.append(s)
    if group:
        groups.append(group)
    rng.shuffle(groups)
    return groups


def _pad(group: Sequence[Sample], skip: int, vocab_index: torch.Tensor, max_len: int,
         answer_only: bool = True
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs and targets of one batch: slot p pairs (feature p - 1, token p) and predicts
    feature p and label p (the target's token after p). The loss mask covers the slots that
    predict the answer (``answer_only``, as EAGLE masks all but the assistant's tokens: drafting
    only ever guesses answers), else every slot past the common prefix ``skip``; the prompt's
    slots still feed the head's attention either way."""
    length = min(max(len(s.token_ids) for s in group) - 1, max_len)
    hidden = group[0].features.shape[1]
    ids = torch.zeros(len(group), length, dtype=torch.long)
    prev = torch.zeros(len(group), length, hidden)
    want = torch.zeros(len(group), length, hidden)
    label = torch.full((len(group), length), -100, dtype=torch.long)
    mask = torch.zeros(len(group), length, dtype=torch.bool)
    for b, s in enumerate(group):
        n = min(len(s.token_ids) - 1, length)
        ids[b, :n] = torch.tensor(s.token_ids[:n])
        want[b, :n] = s.features[:n].float()
        prev[b, 1:n] = s.features[: n - 1].float()
        label[b, :n] = vocab_index[torch.tensor(s.labels[:n])]
        first = max(skip, s.num_prompt_tokens - 1) if answer_only else skip
        mask[b, first:n] = True
    return ids, prev, want, label, mask


def eagle_loss(head: EagleHead, embed: torch.nn.Embedding, lm_rows: torch.Tensor,
               ids: torch.Tensor, prev: torch.Tensor, want: torch.Tensor, label: torch.Tensor,
               mask: torch.Tensor, noise: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss on one batch: smooth-L1 on the features + 0.1 x cross-entropy on the draft
    vocabulary; also the top-1 agreement with the target's token (what greedy acceptance is)."""
    if noise:
        prev = prev + (torch.rand_like(prev) - 0.5) * 2 * noise
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    guess = head(embed(ids), prev, positions)
    m = mask[..., None].float()
    reg = (F.smooth_l1_loss(guess.float(), want, reduction="none") * m).sum() / (
        m.sum() * want.shape[-1])
    logits = guess[mask] @ lm_rows.T
    lab = torch.where(label[mask] >= 0, label[mask], -100)
    ce = F.cross_entropy(logits.float(), lab, ignore_index=-100)
    agree = ((logits.argmax(-1) == lab) & (lab >= 0)).float().mean()
    loss = reg + 0.1 * ce
    return loss, {"loss": loss.item(), "reg": reg.item(), "ce": ce.item(),
                  "top1": agree.item()}


def train_eagle_head(head: EagleHead, target: Any, samples: Sequence[Sample], *,
                     steps: int | None = None, minutes: float | None = None,
                     lr: float = 1e-3, tokens_per_batch: int = 4096, noise: float = 0.2,
                     seed: int = 0, max_len: int = 512, log_every: int = 10,
                     log: Callable[[dict], Any] | None = None, bf16: bool = True,
                     answer_only: bool = True,
                     validate: Callable[[], dict] | None = None, validate_every: int = 0
                     ) -> list[dict]:
    """AdamW on :func:`eagle_loss` over ``samples``, for ``steps`` steps or ``minutes`` of wall
    time (whichever is given; the cosine schedule assumes ``steps``, or an estimate from the
    first steps' pace). The target stays frozen; only ``head``'s weights change.

    With ``validate`` (held-out answers' figures, ``"top1"`` among them) every
    ``validate_every`` steps and at the end, the head ends with the weights of its best
    validation top-1 (early stopping: a small data set is learnt by heart long before the
    time is up); each check is a history entry ``{"step", "validation"}``."""
    if steps is None and minutes is None:
        raise ValueError("give steps or minutes")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    vocab = target.config.vocab_size
    index = torch.full((vocab,), -100, dtype=torch.long)
    index[head.draft_vocab] = torch.arange(len(head.draft_vocab))
    weight = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    lm_rows = weight[head.draft_vocab].detach().float()
    embed = target.embed_tokens
    skip = common_prefix(samples)
    scale = float(torch.cat([s.features.float() for s in samples[:64]]).std())
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    head.train()
    history: list[dict] = []
    start, step, total = time.perf_counter(), 0, steps
    deadline = None if minutes is None else start + 60 * minutes
    best: tuple[float, dict[str, torch.Tensor]] | None = None
    checked_at = -1  # the step of the last check

    def check() -> None:
        nonlocal best, checked_at
        checked_at = step
        stats = validate()  # type: ignore[misc]
        history.append({"step": step, "validation": stats,
                        "seconds": round(time.perf_counter() - start, 1)})
        if log is not None:
            log(history[-1])
        if best is None or stats["top1"] > best[0]:
            best = (stats["top1"], {k: v.detach().clone() for k, v in
                                    head.state_dict().items()})
        head.train()

    while True:
        for group in batches(samples, tokens_per_batch, rng, max_len):
            if (total is not None and step >= total) or (
                    deadline is not None and time.perf_counter() > deadline):
                if validate is not None:
                    if checked_at != step:
                        check()  # the last steps' weights, unless just checked
                    head.load_state_dict(best[1])  # type: ignore[index]
                head.eval()
                return history
            if total is None and step == 5 and minutes is not None:  # from the pace so far
                pace = (time.perf_counter() - start) / step
                total = max(step + 1, int(60 * minutes / pace))
            warm = min(1.0, (step + 1) / 20)
            frac = step / total if total else 0.0
            for g in opt.param_groups:
                g["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1))))
            batch = _pad(group, skip, index, max_len, answer_only)
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16 and not
                                next(head.parameters()).is_cuda):
                loss, stats = eagle_loss(head, embed, lm_rows, *batch, noise=noise * scale)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            stats.update(step=step, seconds=round(time.perf_counter() - start, 1),
                         tokens=int(batch[4].sum()))
            history.append(stats)
            if log is not None and (step % log_every == 0 or step == 1):
                log(stats)
            if validate is not None and validate_every and step % validate_every == 0:
                check()


def new_head(target: Any, samples: Sequence[Sample], draft_vocab_size: int,
             trained_depth: int, seed: int = 0, meta: dict | None = None) -> EagleHead:
    """A freshly initialised head for ``target`` with the draft vocabulary of ``samples``."""
    torch.manual_seed(seed)
    vocab = draft_vocabulary(samples, draft_vocab_size, target.config.vocab_size)
    head = EagleHead(target.config, vocab, trained_depth, meta)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() > 1:
                p.normal_(0, 0.02)
            else:
                p.zero_()
    head.inv_freq = target.inv_freq
    return head.to(target.dtype)

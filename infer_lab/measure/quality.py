"""What a change to the model costs in quality: perplexity and greedy agreement (Chapter 8).

Quantization, like any approximation, is judged against the model it approximates:

- :func:`perplexity` of a held-out text, with a sliding window of stated length, so that the
  figure is comparable across formats (the window changes the number: more context, lower
  perplexity) and a text longer than the model's context can be scored.
- :func:`greedy_agreement`: the reference model decodes ``n`` tokens greedily; the candidate is
  fed the same tokens (teacher forcing) and we count how often its top-1 choice is the same.
  Teacher forcing keeps one early disagreement from making every later position incomparable;
  the free-running figure (how many tokens until the first difference) is reported beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # [1, S] ids -> [1, S, vocab] logits


@dataclass(frozen=True)
class Perplexity:
    """``exp(mean NLL)`` over ``tokens`` scored positions, each with up to ``window`` tokens of
    context (``stride`` new tokens scored per window)."""

    perplexity: float
    nll: float
    tokens: int
    window: int
    stride: int


@torch.inference_mode()
def perplexity(model: LogitsFn, token_ids: Sequence[int] | torch.Tensor, window: int = 256,
               stride: int | None = None) -> Perplexity:
    """Perplexity of ``token_ids`` under ``model`` with a sliding window.

    Each window holds ``window`` tokens and scores only its last ``stride`` (default
    ``window // 2``) ones, so every scored token after the first window sees at least
    ``window - stride`` tokens of context. The first token is never scored (nothing predicts it).
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    stride = window // 2 if stride is None else stride
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in 1..window ({window}), got {stride}")
    if ids.numel() < 2:
        raise ValueError("perplexity needs a text of at least 2 tokens")
    device = getattr(model, "device", ids.device)
    total, count, end = 0.0, 0, 0
    while end < ids.numel():
        new_end = min(end + stride, ids.numel()) if end else min(window, ids.numel())
        start = max(0, new_end - window)
        chunk = ids[start:new_end].to(device)
        logits = model(chunk[None])[0].float()
        targets = chunk[1:]
        nll = F.cross_entropy(logits[:-1], targets, reduction="none")
        scored = new_end - max(end, 1)  # positions end .. new_end - 1, never position 0
        total += float(nll[-scored:].sum())
        count += scored
        end = new_end
    mean = total / count
    return Perplexity(math.exp(mean), mean, count, window, stride)


@dataclass(frozen=True)
class Agreement:
    """Top-1 agreement of a candidate with a reference over ``tokens`` greedy positions.

    ``teacher_forced``: fraction of positions where the candidate, fed the reference's own
    continuation, picks the reference's token. ``first_divergence``: per prompt, how many
    tokens the two free-running greedy decodes share before they first differ (``n`` if never).
    """

    teacher_forced: float
    first_divergence: list[int]
    tokens: int


def _greedy(model: LogitsFn, prompt: list[int], n: int, device: torch.device) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids], device=device))[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@torch.inference_mode()
def greedy_agreement(reference: LogitsFn, candidate: LogitsFn,
                     prompts: Sequence[Sequence[int]], n: int = 32) -> Agreement:
    """How often ``candidate`` makes ``reference``'s greedy choice (see :class:`Agreement`).

    Plain full-sequence forwards, no cache: this is a measuring stick, not a fast path.
    """
    if n < 1 or not prompts:
        raise ValueError("greedy_agreement needs at least one prompt and n >= 1")
    device = getattr(reference, "device", torch.device("cpu"))
    same, total, divergence = 0, 0, []
    for prompt in prompts:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        ref = _greedy(reference, prompt, n, device)
        seq = torch.tensor([prompt + ref], device=device)
        cand_next = candidate(seq)[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        same += sum(int(a == b) for a, b in zip(cand_next, ref, strict=True))
        total += n
        free = _greedy(candidate, prompt, n, device)
        divergence.append(next((i for i, (a, b) in enumerate(zip(free, ref, strict=True))
                                if a != b), n))
    return Agreement(same / total, divergence, total)


# A stated text for the quality figures of Chapter 8 and benchmarks/quantization.py: the 23rd
# Psalm and Ecclesiastes 3:1-8 in the King James Version (public domain). The bundled model was
# trained on the KJV with 2 % of chapters held out, so these may have been seen in training: the
# figure compares formats with each other, it does not claim generalisation.
KJV_PASSAGE = (
    "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures: he "
    "leadeth me beside the still waters. He restoreth my soul: he leadeth me in the paths of "
    "righteousness for his name's sake. Yea, though I walk through the valley of the shadow of "
    "death, I will fear no evil: for thou art with me; thy rod and thy staff they comfort me. "
    "Thou preparest a table before me in the presence of mine enemies: thou anointest my head "
    "with oil; my cup runneth over. Surely goodness and mercy shall follow me all the days of my "
    "life: and I will dwell in the house of the LORD for ever. To every thing there is a season, "
    "and a time to every purpose under the heaven: A time to be born, and a time to die; a time "
    "to plant, and a time to pluck up that which is planted; A time to kill, and a time to heal; "
    "a time to break down, and a time to build up; A time to weep, and a time to laugh; a time to "
    "mourn, and a time to dance; A time to cast away stones, and a time to gather stones "
    "together; a time to embrace, and a time to refrain from embracing; A time to get, and a time "
    "to lose; a time to keep, and a time to cast away; A time to rend, and a time to sew; a time "
    "to keep silence, and a time to speak; A time to love, and a time to hate; a time of war, and "
    "a time of peace."
)

"""The offline API: ``il.LLM(...).generate(prompts, sampling_params)``, as in vLLM.

All prompts are added at once (they all "arrive" at t = 0) and the engine steps until every one
is done; outputs come back in the prompts' order, as in vLLM.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

from infer_lab.engine.config import EngineConfig
from infer_lab.engine.engine import LLMEngine
from infer_lab.engine.outputs import RequestOutput
from infer_lab.engine.sampling_params import SamplingParams
from infer_lab.model.loader import load
from infer_lab.model.tokenizer import Tokenizer
from infer_lab.model.transformer import Transformer

Prompt = str | Sequence[int]


class LLM:
    """A model, its tokenizer and an :class:`LLMEngine`, for batch generation.

    ``LLM()`` loads the bundled model; ``LLM("dir or hub id", device=, dtype=)`` another one;
    ``LLM(model, tokenizer=tok)`` wraps a model already in memory. ``config`` (an
    :class:`EngineConfig`) and other keywords (``max_num_seqs``, ``num_kv_blocks``, ``policy``,
    ``enable_prefix_caching``, ...) build the engine's one configuration.
    """

    def __init__(
        self,
        model: str | os.PathLike | Transformer | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        device: Any = None,
        dtype: Any = None,
        config: EngineConfig | None = None,
        **engine_kwargs: Any,
    ) -> None:
        config = EngineConfig.from_kwargs(config, **engine_kwargs)  # bad options fail before load
        if isinstance(model, Transformer):
            if tokenizer is None:
                raise ValueError("pass tokenizer= together with a model object")
            self.model, self.tokenizer = model, tokenizer
        else:
            self.model, self.tokenizer = load(model, device, dtype, config.quantization)
            if tokenizer is not None:
                self.tokenizer = tokenizer
        self.engine = LLMEngine(self.model, self.tokenizer, config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Release what the engine started (tensor-parallel workers); the LLM is unusable after."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); one params object, or one per prompt."""
        batch: list[Prompt]
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            batch = [prompts]  # type: ignore[list-item]  # one prompt: text or token ids
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        if not batch:
            return []
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"{len(params)} sampling params for {len(batch)} prompts")
        engine = self.engine
        ids = [f"gen-{next(self._ids)}" for _ in batch]
        added = []
        try:
            for rid, prompt, p in zip(ids, batch, params):
                engine.add_request(rid, prompt, p)
                added.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            for rid in added:  # leave the engine clean for the next call
                engine.abort(rid)
            raise

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        wanted, generated = set(ids), 0
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    generated += sum(len(c.token_ids) for c in out.outputs)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(f"{generated} tokens out", refresh=False)
            if not self.engine.has_unfinished_requests() and len(done) < len(ids):
                raise RuntimeError("the engine stopped with requests unfinished")
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]

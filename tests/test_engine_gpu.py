"""CUDA graphs for decode steps give the same logits as the eager forward (needs a GPU)."""

from __future__ import annotations

import pytest
import torch

import infer_lab as il
from infer_lab.engine import LLMEngine
from infer_lab.engine.step_sampler import SampledTokens
from tests.engine_fixtures import assert_no_leak, varied_prompts
from tests.helpers import make_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_equals_eager(tmp_path):
    make_checkpoint(tmp_path, "llama3")
    model, tok = il.load(tmp_path, device="cuda", dtype=torch.float32)
    prompts = [p for p, _ in varied_prompts(13, seed=1)]
    logits = {}
    for graphs in (False, True):
        engine = LLMEngine(model, tok, use_cuda_graphs=graphs, max_num_seqs=16,
                           num_kv_blocks=256, enable_prefix_caching=False)
        if graphs:
            assert engine.runner.graphs, f"capture failed: {engine.runner.graph_error}"
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, il.SamplingParams(max_tokens=6, temperature=0,
                                                            ignore_eos=True))
        engine.step()  # the prefill (eager in both)
        outs = []
        while engine.has_unfinished_requests():  # step() with the logits kept, greedy
            sched = engine.scheduler.schedule()
            got, seqs = engine.executor.execute_model(sched)
            outs.append(got.float().cpu())
            engine.scheduler.update_after_forward(sched, 0.0)
            sampled = SampledTokens(seqs, [[(t, None)] for t in got.argmax(-1).tolist()])
            engine.scheduler.update_from_output(sampled, 0.0)
            engine.scheduler.retire(sched, sampled, {}, 0.0)
            for r in [r for r in engine.requests.values() if r.is_finished]:
                engine.requests.pop(r.request_id)
        assert_no_leak(engine)
        logits[graphs] = outs
    assert len(logits[True]) == len(logits[False])
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

"""The EAGLE proposer: drafts from the target's own features, as a chain or a tree.

Each target forward hands the proposer its last hidden states (the runner's
``hidden_states_hook``; the model computes them only when asked, through its attention
context), and the proposer stores each row's *feature* at that row's cache slot, in a pool laid
out like the KV cache and addressed by the target's block tables. So the features of every
position this engine's target has computed are at hand, whichever request computed them: a
prefix-cache hit in this engine's own pool, a preempted and recomputed sequence and a
verification forward all leave the pool complete, and no second target pass is ever needed.
K/V written from outside (a KV tier's restore, a prefill server's blocks) would carry no
features, so those are refused with EAGLE (``kv_connector.refuse_eagle``).

The head (:class:`~infer_lab.model.eagle_head.EagleHead`) has a KV cache of its own in the same
pool layout. Its slot p holds the pair (feature of p - 1, token p), so what a slot holds depends
only on the tokens up to p. To propose for a sequence of N tokens, the head first catches up
on the slots from where its cache is valid up to N - 1 (the last one pairs the newest feature,
from the last verification, with the newest token); its output there guesses the feature of
position N - 1, and the LM head turns that into candidates for token N. Each further level of
the tree feeds the guessed features back in, one query row per node that has children, each
row seeing the cached context and its own ancestors (the tree mask again). A chain is the tree
with one node per level.

Only the head's cache slots up to N - 1 stay valid after a step: the guessed features past them
are replaced by the target's real ones at the next catch-up. The target's verification may
keep a path through a tree that is not the first branch; the spec decoder then moves the K/V
and the features of that path to the slots where the sequence continues (:meth:`move_slots`).

Which requests speculate (the same rules as every proposer's): greedy and sampled ones, with
logprobs and with penalties (tested: the same tokens and log-probs as without speculation);
trees verify by the deterministic rule (the target samples each node with the request's noise
of that depth), ``draft_sampling: "sampled"`` is for chains only. Structured output and ``n > 1``
turn speculation off for that request alone (the draft does not know the grammar; forked samples
would need a feature pool per branch). ``num_speculative_tokens`` (or a tree's depth) above the
depth recorded with the head (``trained_depth``: the chain length its acceptance was validated
at) is refused, not clamped; a tree wider than the step's token budget is refused at start-up.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from infer_lab.cache.batch import PagedBatch, flatten_chunks
from infer_lab.cache.kv_quant import attention_backend_for, make_paged_kv_cache
from infer_lab.cache.paged import PagedAttentionContext
from infer_lab.engine.draft_tree import DraftTree, chain_paths, tree_mask, tree_parents
from infer_lab.engine.sampler import sampling_probs
from infer_lab.kernels.linear import linear
from infer_lab.model.eagle_head import EagleHead, load_eagle_head
from infer_lab.utils import cdiv


class EagleProposer:
    """Chain or tree drafts from an EAGLE head over the target's features.

    ``paths`` is the tree (vLLM's ``speculative_token_tree``, parents first); a chain of k is
    ``(0,), (0, 0), ...``. ``sampled``: chains only; a sampling request's guesses are drawn from
    the head's distribution q (the request's temperature, top-k, top-p) and kept in
    ``seq.spec_probs`` for the rejection rule.
    """

    def __init__(self, head: EagleHead | Any, target: Any, engine_config: Any, runner: Any,
                 paths: tuple[tuple[int, ...], ...], sampled: bool = False) -> None:
        if runner is None:
            raise ValueError("the EAGLE proposer needs the model runner (its hidden states)")
        self.head = head if isinstance(head, EagleHead) else load_eagle_head(head, target)
        self.head.bind(target).eval()
        depth = max(map(len, paths))
        if depth > self.head.trained_depth:
            raise ValueError(
                f"a draft of depth {depth} (num_speculative_tokens, or the depth of "
                f"speculative_token_tree) is deeper than the depth recorded with this EAGLE "
                f"head, trained_depth={self.head.trained_depth}: the chain length its "
                f"acceptance was validated at after training (its training itself looks one "
                f"token ahead); use num_speculative_tokens <= {self.head.trained_depth} (the "
                f"engine refuses rather than clamps)")
        self.target, self.device, self.dtype = target, target.device, target.dtype
        self.paths, self.parents, self.depth = paths, tree_parents(paths), depth
        self.ranks = [p[-1] for p in paths]
        tree = DraftTree(tuple(self.ranks), self.parents)
        self.ancestors = [set(tree.path_to(j)) for j in range(len(paths))]  # each with itself
        self.is_chain = paths == chain_paths(depth)
        self.sampled = sampled
        bs = engine_config.block_size
        self.block_size, self.scratch = bs, engine_config.num_kv_blocks
        self.max_blocks = cdiv(engine_config.max_model_len, bs)
        self.cache = make_paged_kv_cache(self.head.config, self.scratch + 1, bs, self.device,
                                         self.dtype)
        self.backend = attention_backend_for(self.cache, None)
        hidden = target.config.hidden_size
        self.features = torch.zeros((self.scratch + 1) * bs, hidden, device=self.device,
                                    dtype=self.dtype)
        self.lm_rows = self._draft_lm_head()
        self.generator = torch.Generator(device=self.device)  # unseeded sampled requests
        self.generator.manual_seed(engine_config.seed + 2)
        self._preemptions: dict[int, int] = {}  # seq_id -> preemptions seen
        runner.hidden_states_hook = self.on_forward

    def _draft_lm_head(self) -> torch.Tensor | None:
        """The target's LM-head rows of the draft vocabulary, in the draft's dtype: a quantized
        head (a GGUF file's Q8_0 table, say) is dequantized once, so a draft step scores its
        V' rows, not the whole vocabulary through the quantized kernel. (A guess scored from
        the dequantized rows can differ from the target's own scoring in the last bits; the
        target verifies every guess, so that costs acceptance, never output.) None: a head of
        neither kind, whose logits are computed whole and then indexed."""
        t = self.target
        head = t.lm_head
        weight = t.embed_tokens.weight if head is None else getattr(head, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype == self.dtype:
            return weight[self.head.draft_vocab].contiguous()
        dequantize = getattr(head, "dequantize", None)
        if callable(dequantize):
            return dequantize(self.dtype)[self.head.draft_vocab].contiguous()
        return None

    # ------------------------------------------------------------------ the target's side
    @torch.inference_mode()
    def on_forward(self, out: Any, batch: PagedBatch, hidden: torch.Tensor) -> None:
        """Store every row's feature at its slot (filler rows write the scratch block)."""
        self.features[batch.slot_mapping.long()] = hidden.to(self.dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of whole blocks: the features and the head's K/V follow the target's."""
        if pairs:
            self.cache.copy_blocks(pairs)
            blocks = self.features.view(self.scratch + 1, self.block_size, -1)
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*pairs))
            blocks[dst] = blocks[src]

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """A tree's accepted path moved down: its features move with its K/V."""
        if src:
            s, d = (torch.tensor(x, device=self.device) for x in (src, dst))
            self.features[d] = self.features[s]

    # ------------------------------------------------------------------ proposing
    @torch.inference_mode()
    def propose(self, seqs: list, ks: list[int], out: Any) -> list[DraftTree | list[int]]:
        """Each sequence's draft: a :class:`DraftTree` with up to ``ks[i]`` nodes (``[]``: none)."""
        drafts: list[DraftTree | list[int]] = [[] for _ in seqs]
        live = [i for i, k in enumerate(ks) if k]
        if not live:
            return drafts
        for i in live:
            seqs[i].spec_probs = []
        roots = self._catch_up([seqs[i] for i in live])
        nodes = [self._nodes(ks[i]) for i in live]
        tokens: list[list[int]] = [[0] * n for n in nodes]
        feats: list[dict[int, torch.Tensor]] = [{-1: roots[r]} for r in range(len(live))]
        done: list[list[int]] = [[] for _ in live]  # nodes the head processed, in slot order
        for depth in range(1, self.depth + 1):
            level = [j for j, p in enumerate(self.paths) if len(p) == depth]
            self._fill_level(level, live, seqs, nodes, tokens, feats)
            frontier = [[j for j in level if j < nodes[r] and self._has_child(j, nodes[r])]
                        for r in range(len(live))]
            if depth == self.depth or not any(frontier):
                break
            self._expand(live, seqs, frontier, tokens, feats, done)
        for r, i in enumerate(live):
            drafts[i] = DraftTree(tuple(tokens[r]), self.parents[: nodes[r]])
        return drafts

    def _nodes(self, k: int) -> int:
        return min(k, len(self.paths))

    def _has_child(self, j: int, n: int) -> bool:
        return any(p == j for p in self.parents[:n])

    def _catch_up(self, seqs: list) -> list[torch.Tensor]:
        """Run the head over each sequence's slots from its valid cache up to its newest token;
        returns each one's guessed feature of its last position."""
        chunks, feats = [], []
        for seq in seqs:
            if self._preemptions.get(seq.seq_id, 0) != seq.num_preemptions:
                seq.draft_computed = 0  # recomputed from scratch: so is the head's cache
            self._preemptions[seq.seq_id] = seq.num_preemptions
            n = seq.num_tokens
            start = min(seq.draft_computed, n - 1)
            chunks.append((seq.token_ids[start:n], start, seq.block_table))
            feats.append(self._slots(seq.block_table, np.arange(start - 1, n - 1)))
            seq.draft_computed = n
        batch = self._batch(chunks)
        index = torch.from_numpy(np.concatenate(feats)).to(self.device)
        features = self.features[index.clamp(min=0)]
        features[index < 0] = 0  # position -1: nothing before the first token
        hidden = self._head(batch, features)
        return list(hidden[batch.logits_indices])

    def _slots(self, table: list[int], positions: np.ndarray) -> np.ndarray:
        """Slot of each position through a block table (-1 for a negative position)."""
        bs = self.block_size
        tab = np.asarray(table, np.int64)
        safe = np.maximum(positions, 0)
        return np.where(positions < 0, -1, tab[safe // bs] * bs + safe % bs)

    def _batch(self, chunks: list[tuple[list[int], int, list[int]]],
               positions: list[np.ndarray] | None = None,
               regions: dict[int, np.ndarray] | None = None) -> PagedBatch:
        batch = flatten_chunks(chunks, self.max_blocks, self.scratch, self.block_size,
                               self.device)
        if positions is not None:  # tree nodes sit at the position of their depth
            batch.positions = torch.from_numpy(np.concatenate(positions)).to(self.device)
        if regions:
            batch.tree_mask = tree_mask(batch.cu_seqlens_q.cpu().numpy(), regions, self.device)
        return batch

    def _head(self, batch: PagedBatch, features: torch.Tensor) -> torch.Tensor:
        ctx = PagedAttentionContext(self.cache, batch, backend=self.backend)
        embeds = self.target.embed_tokens(batch.input_ids)
        return self.head(embeds, features, batch.positions, ctx)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[rows, V']``."""
        if self.lm_rows is not None:
            return linear(hidden, self.lm_rows)
        return self.target.compute_logits(hidden)[:, self.head.draft_vocab]

    def _fill_level(self, level: list[int], live: list[int], seqs: list, nodes: list[int],
                    tokens: list[list[int]], feats: list[dict[int, torch.Tensor]]) -> None:
        """The tokens of one level's nodes: each parent's candidates, by rank."""
        rows, want = [], []
        for r in range(len(live)):
            for parent in dict.fromkeys(self.parents[j] for j in level if j < nodes[r]):
                rows.append((r, parent))
                want.append(feats[r][parent])
        if not rows:
            return
        logits = self._logits(torch.stack(want))
        top = max(self.ranks[j] for j in level) + 1
        ranked = self.head.draft_vocab[logits.topk(min(top, logits.shape[1]), -1).indices].tolist()
        for (r, parent), cands, row in zip(rows, ranked, logits):
            seq = seqs[live[r]]
            kids = [j for j in level if j < nodes[r] and self.parents[j] == parent]
            if self.sampled and not seq.request.params.greedy:
                (j,) = kids  # a chain: one child per level
                tokens[r][j] = self._sample(row, seq)
                continue
            for j in kids:
                tokens[r][j] = cands[self.ranks[j]]

    def _sample(self, logits: torch.Tensor, seq: Any) -> int:
        """A draw from q, the head's distribution under the request's settings, kept as a
        full-vocabulary row (zero outside the draft vocabulary)."""
        full = torch.full((self.target.config.vocab_size,), float("-inf"), device=self.device)
        full[self.head.draft_vocab] = logits.float()
        q = sampling_probs(full[None], [seq.request.params])[0]
        token = int(torch.multinomial(q, 1, generator=seq.generator or self.generator))
        seq.spec_probs.append(q)
        return token

    def _expand(self, live: list[int], seqs: list, frontier: list[list[int]],
                tokens: list[list[int]], feats: list[dict[int, torch.Tensor]],
                done: list[list[int]]) -> None:
        """One head forward over every sequence's frontier: each node's guessed feature."""
        chunks, inputs, positions, regions, who = [], [], [], {}, []
        for r, nodes in enumerate(frontier):
            if not nodes:
                continue
            seq = seqs[live[r]]
            n, first = seq.num_tokens, len(done[r])
            done[r] += nodes
            chunks.append(([tokens[r][j] for j in nodes], n + first, seq.block_table))
            inputs += [feats[r][self.parents[j]] for j in nodes]
            depth = len(self.paths[nodes[0]])
            positions.append(np.full(len(nodes), n - 1 + depth, np.int64))
            if not self.is_chain:
                regions[len(chunks) - 1] = np.array(
                    [[b in self.ancestors[j] for b in done[r]] for j in nodes], bool)
            who.append((r, nodes))
        batch = self._batch(chunks, positions, regions)
        batch.logits_indices = torch.arange(batch.num_tokens, device=self.device)
        hidden = self._head(batch, torch.stack(inputs))
        row = 0
        for r, nodes in who:
            for j in nodes:
                feats[r][j] = hidden[row]
                row += 1

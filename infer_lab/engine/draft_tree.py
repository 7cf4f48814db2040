"""Draft trees: several guesses per position, verified in one forward with a tree mask.

A chain of k guesses is one path; a tree keeps several candidates at a position (the draft's
top-2 at the first token, say) so that when the first candidate is wrong, a second may still be
right. The target scores every node in one forward: the nodes are extra query rows of the
flattened batch, laid out parents before children, each at the position of its depth, and each
may attend only to its ancestors (and to the cached context): that is the *tree attention
mask*. Its K/V go to consecutive cache slots, in node order; once verification has picked the
longest accepted path, the K/V of that path's nodes are copied down to the slots where the
sequence continues (:meth:`DraftTree.compaction`), and the rest is rolled back with the other
rejected slots.

The shape of a tree is vLLM's ``speculative_token_tree``: a list of paths, each a tuple of child
ranks (``(0,)`` is the draft's best first token, ``(1,)`` its second best, ``(0, 0)`` the best
token after ``(0,)``...); every path's parent path must be in the list.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DraftTree:
    """Proposed tokens as a tree: ``parents[j]`` is node ``j``'s parent (``-1``: the root, the
    sequence's last real token); parents come before their children."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each node's depth: 1 for a child of the root."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return depth

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (``[]`` for the root, -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_mask(self) -> np.ndarray:
        """Bool ``[n + 1, n + 1]`` over the root (row/column 0) and the nodes: row i sees column
        j iff j is i itself or one of its ancestors."""
        n = len(self.parents)
        mask = np.zeros((n + 1, n + 1), bool)
        mask[:, 0] = True
        for j, p in enumerate(self.parents):
            mask[j + 1] = mask[p + 1]
            mask[j + 1, j + 1] = True
        return mask

    def prefix(self, n: int) -> DraftTree:
        """The first ``n`` nodes: still a tree, since parents come first."""
        return DraftTree(self.tokens[:n], self.parents[:n])

    def accepted_nodes(self, target: Sequence[int]) -> list[int]:
        """The nodes of the longest path the target agrees with.

        ``target[0]`` is the target's token at the root, ``target[j + 1]`` at node ``j``. From
        the root, step to the child whose token is the target's there; stop where none is.
        """
        nodes: list[int] = []
        at, want = -1, target[0]
        while True:
            child = next((j for j, p in enumerate(self.parents)
                          if p == at and self.tokens[j] == want), None)
            if child is None:
                return nodes
            nodes.append(child)
            at, want = child, target[child + 1]

    def accepted_path(self, target: Sequence[int]) -> list[int]:
        """The target's tokens along the longest path it agrees with, plus its own next one."""
        return [target[0]] + [target[j + 1] for j in self.accepted_nodes(target)]

    def compaction(self, nodes: Sequence[int], first_slot_index: int) -> tuple[list[int],
                                                                                 list[int]]:
        """Cache moves after acceptance: the accepted ``nodes``' K/V, written at sequence index
        ``first_slot_index + j`` for node j, belong at ``first_slot_index + depth - 1``.
        Returns ``(src, dst)`` indices, only those that move."""
        src = [first_slot_index + j for j in nodes]
        dst = [first_slot_index + d for d in range(len(nodes))]
        moves = [(s, d) for s, d in zip(src, dst) if s != d]
        return [s for s, _ in moves], [d for _, d in moves]


def parse_token_tree(spec: object) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``speculative_token_tree`` (a list of rank paths, or its string) checked: ranks
    are non-negative integers and every path's parent path comes earlier in the list."""
    if isinstance(spec, str):
        try:
            spec = ast.literal_eval(spec)
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"speculative_token_tree {spec!r} is not a list of tuples") from e
    if not isinstance(spec, (list, tuple)) or not spec:
        raise ValueError("speculative_token_tree must be a non-empty list of paths such as "
                         "[(0,), (1,), (0, 0)]")
    paths: list[tuple[int, ...]] = []
    for raw in spec:
        if not isinstance(raw, (list, tuple)) or not raw or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in raw):
            raise ValueError(f"speculative_token_tree path {raw!r} must be a non-empty tuple of "
                             "ranks >= 0")
        path = tuple(raw)
        if path in paths:
            raise ValueError(f"speculative_token_tree lists the path {path} twice")
        if len(path) > 1 and path[:-1] not in paths:
            raise ValueError(f"speculative_token_tree path {path} comes before (or without) its "
                             f"parent {path[:-1]}")
        paths.append(path)
    return tuple(sorted(paths, key=lambda p: (len(p), p)))  # parents first, by depth


def chain_paths(k: int) -> tuple[tuple[int, ...], ...]:
    """The chain of ``k`` as a token tree: ``(0,), (0, 0), ...``."""
    return tuple((0,) * d for d in range(1, k + 1))


def tree_parents(paths: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Each path's parent node index (-1: the root) in a parents-first list of paths."""
    index = {p: j for j, p in enumerate(paths)}
    return tuple(index[p[:-1]] if len(p) > 1 else -1 for p in paths)


def tree_mask(cu_seqlens: np.ndarray, regions: dict[int, np.ndarray],
              device: torch.device | str = "cpu") -> torch.Tensor:
    """The batch's ``tree_mask`` (bool ``[T, W]``, see :class:`~infer_lab.cache.PagedBatch`).

    ``regions[b]`` is chunk b's visibility of its sequence's last ``w_b`` keys, ``[q_b, w_b]``
    (``w_b >= q_b``); every other chunk, and the columns left of a region, keep the causal rule.
    """
    width = max(r.shape[1] for r in regions.values())
    q_lens = np.diff(cu_seqlens)
    within = np.arange(int(cu_seqlens[-1])) - np.repeat(cu_seqlens[:-1], q_lens)
    limit = width - np.repeat(q_lens, q_lens) + within  # the causal rule, by column
    mask = np.arange(width)[None, :] <= limit[:, None]
    for b, region in regions.items():
        q, w = region.shape
        if q != q_lens[b] or w < q:
            raise ValueError(f"chunk {b}: a tree region of shape {region.shape} for "
                             f"{q_lens[b]} query rows")
        mask[cu_seqlens[b] : cu_seqlens[b + 1], width - w :] = region
    return torch.from_numpy(mask).to(device)

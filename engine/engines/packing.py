"""Prefix-shared scoring of log-likelihood requests: the requests of a multiple-choice item share their context
(lm-eval asks for log p(choice | question) once per choice), so each context is computed once and its choices
branch off it as a tree, several trees packed into one row, one forward per row.

A row is the concatenation of trees; a tree is its context followed by each continuation but its last token
(the last token is only a target). Token q sees token k when both are in the same tree, k comes first, and k is
in the context or in q's own continuation (`TreePack.mask`); positions restart at the context's length for every
continuation, so each continuation sees exactly the positions and keys it would see alone. Logits are computed
only where a target is scored: the context's last token (it predicts every continuation's first token) and each
continuation's own tokens but its last (`TreePack.rows`).

On ARC-Easy + SciQ + PIQA (300 pooled items, SmolLM2's tokenizer) the 890 requests are 55,409 tokens scored one
by one and 20,783 as trees (x2.67 fewer), and 8,003 of those need logits: scoring is x2.7 (fp32) to x3.3 (bf16)
faster on SmolLM2 (benchmarks/bench_task_scoring.py, BENCHMARKS.md).

Shapes: N = a row's tokens, R = the positions whose logits are needed, V = vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

Pair = tuple[list[int], list[int]]  # (context, continuation) token ids

ROW_TOKENS = 256  # a row's budget (a tree longer than it gets a row of its own): attention over a row is
# block-diagonal work done densely, 8% of SmolLM2's FLOPs at 256 tokens, 16% at 512


@dataclass
class TreePack:
    """One row: `ids`, `positions` [N]; `tree`, `branch` [N] (branch 0: the context); `rows` [R] the positions
    whose logits are needed; `targets`: per request (its index in the caller's list, where its R-rows start,
    its continuation)."""

    ids: torch.Tensor
    positions: torch.Tensor
    tree: torch.Tensor
    branch: torch.Tensor
    rows: torch.Tensor
    targets: list[tuple[int, int, list[int]]]
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    def mask(self, window: Optional[int] = None) -> torch.Tensor:
        """[N, N] bool, True where query q may see key k (under a sliding `window`: p_q - p_k < window, the
        transformers rule)."""
        if window not in self._masks:
            idx = torch.arange(self.num_tokens, device=self.ids.device)
            m = (self.tree[:, None] == self.tree[None, :]) & (idx[None, :] <= idx[:, None])
            m &= (self.branch[None, :] == 0) | (self.branch[None, :] == self.branch[:, None])
            if window is not None:
                m &= (self.positions[:, None] - self.positions[None, :]) < window
            self._masks[window] = m
        return self._masks[window]

    def longest_span(self) -> int:
        """The most positions any query looks back over (a window at least this wide changes nothing)."""
        return int(self.positions.max()) + 1 if self.num_tokens else 0


def _trees(pairs: list[Pair]) -> tuple[list[tuple[list[int], list[tuple[int, list[int]]]]], list[int]]:
    """Requests grouped by context, in first-seen order: [(context, [(request index, continuation)])]; the
    indices of requests with no context (nothing to predict their first token from) apart."""
    groups: dict[tuple, list[tuple[int, list[int]]]] = {}
    alone = []
    for i, (ctx, cont) in enumerate(pairs):
        if not ctx or not cont:
            alone.append(i)
            continue
        groups.setdefault(tuple(ctx), []).append((i, list(cont)))
    return [(list(c), g) for c, g in groups.items()], alone


def _size(tree) -> int:
    ctx, branches = tree
    return len(ctx) + sum(len(c) - 1 for _, c in branches)


def pack_trees(pairs: list[Pair], row_tokens: int = ROW_TOKENS,
               device: torch.device | str = "cpu") -> tuple[list[TreePack], list[int]]:
    """(the rows that score `pairs` as trees, longest first; the indices of requests left to score alone: those
    with an empty context or continuation). Trees go into rows of at most `row_tokens` tokens in order of size
    (next fit; a larger tree has a row of its own)."""
    trees, alone = _trees(pairs)
    trees.sort(key=lambda t: -_size(t))
    rows: list[list] = []
    used = row_tokens  # forces a first row
    for t in trees:
        n = _size(t)
        if used + n > row_tokens:
            rows.append([])
            used = 0
        rows[-1].append(t)
        used += n
    return [_row(r, device) for r in rows], alone


def _row(trees, device) -> TreePack:
    ids, pos, tree, branch, rows, targets = [], [], [], [], [], []
    for ti, (ctx, branches) in enumerate(trees):
        last = len(ids) + len(ctx) - 1  # the context's last token: its logits predict every first token
        ids += ctx
        pos += range(len(ctx))
        tree += [ti] * len(ctx)
        branch += [0] * len(ctx)
        for bi, (i, cont) in enumerate(branches, start=1):
            start = len(ids)
            body = cont[:-1]
            ids += body
            pos += range(len(ctx), len(ctx) + len(body))
            tree += [ti] * len(body)
            branch += [bi] * len(body)
            targets.append((i, len(rows), cont))
            rows += [last, *range(start, start + len(body))]
    t = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return TreePack(t(ids), t(pos), t(tree), t(branch), t(rows), targets)


def tree_results(pack: TreePack, logits: torch.Tensor) -> list[tuple[int, tuple[float, bool]]]:
    """logits [R, V] (float32) of `pack.rows` -> per request (its index, (sum of log p of its continuation,
    whether every continuation token was the argmax))."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for i, at, cont in pack.targets:
        lp = logp[at:at + len(cont)]
        target = torch.tensor(cont, dtype=torch.long, device=lp.device)
        out.append((i, (float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))))
    return out

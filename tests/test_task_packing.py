"""Prefix-shared scoring (engine/engines/packing.py): the requests that share a context are scored as one tree, and
every request's log-likelihood and greedy flag equal scoring it alone (fp32, within float rounding), on every
architecture the engines run (Gemma 3's sliding window of 8 shorter than the trees here), for hf and native, eager and
sdpa attention. Mutations of the mask (a continuation seeing its siblings, positions not restarting) are caught."""
from __future__ import annotations

import pytest
import torch

from engine.engines import get, make_backend
from engine.engines.logits import LogitsSession
from engine.engines.packing import pack_trees, tree_results
from support import make_trial
from test_native import hf_tiny

TOL = 1e-4  # fp32 log-likelihood (a sum of a few log-probs): another order of the same sums
KINDS = ["llama", "qwen2", "mistral", "llama3-rope", "gemma3", "gemma3-softcap"]


def _pairs(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Multiple-choice-like requests: 6 contexts of 3-22 tokens, 1-4 continuations each of 1-9 tokens (one context
    asked twice with the same continuation), and a context shared by requests that are not adjacent."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(3, 300, (n,), generator=g).tolist()  # noqa: E731
    pairs = []
    for n_ctx, conts in ((12, (3, 5, 1, 9)), (22, (4, 4)), (3, (7,)), (17, (2, 6, 3)), (8, (1, 1, 5))):
        ctx = r(n_ctx)
        pairs += [(ctx, r(c)) for c in conts]
    pairs.append((pairs[0][0], pairs[0][1]))  # the same request twice, far from the first
    pairs.append((r(5), r(3)))
    return pairs


def _session(kind: str, backend: str, attention: str) -> LogitsSession:
    loaded = hf_tiny(kind, attn=attention)
    trial = make_trial(loaded.spec, backend=backend, attention=attention, kv_cache="contiguous")
    return LogitsSession(get(backend), trial, loaded, make_backend(loaded, trial))


def test_trees_share_contexts_and_restart_positions():
    pairs = _pairs()
    packs, alone = pack_trees(pairs, row_tokens=32)
    assert alone == []
    n_tokens = sum(p.num_tokens for p in packs)
    contexts = {tuple(c) for c, _ in pairs}
    assert n_tokens == sum(len(c) for c in contexts) + sum(len(t) - 1 for _, t in pairs)
    assert sorted(i for p in packs for i, _, _ in p.targets) == list(range(len(pairs)))
    assert all(p.num_tokens <= 32 for p in packs if len({int(t) for t in p.tree}) > 1)  # the budget, but lone trees
    for p in packs:
        m = p.mask()
        for q in range(p.num_tokens):
            for k in range(p.num_tokens):
                same = bool(p.tree[q] == p.tree[k])
                want = same and k <= q and (int(p.branch[k]) == 0 or bool(p.branch[k] == p.branch[q]))
                assert bool(m[q, k]) == want
        # a continuation's positions follow its context's, whichever branch it is
        for t in set(p.tree.tolist()):
            ctx_len = int(((p.tree == t) & (p.branch == 0)).sum())
            for b in set(p.branch[p.tree == t].tolist()) - {0}:
                sel = (p.tree == t) & (p.branch == b)
                assert p.positions[sel].tolist() == list(range(ctx_len, ctx_len + int(sel.sum())))
    # rows: the context's last token, then the continuation's own tokens but the last
    for p in packs:
        assert p.rows.numel() == sum(len(c) for _, _, c in p.targets)


def test_requests_without_a_context_are_scored_alone():
    packs, alone = pack_trees([([], [5, 6]), ([4], [7]), ([4], [])])
    assert alone == [0, 2] and sum(len(p.targets) for p in packs) == 1


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("kind", KINDS)
def test_tree_scores_equal_scoring_each_request_alone(kind, backend, attention):
    s = _session(kind, backend, attention)
    assert s.backend.scores_trees
    pairs = _pairs()
    got = s.loglikelihood(pairs, lambda m: None)
    alone = [s.padded_loglikelihood([p], lambda m: None)[0] for p in pairs]
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in alone], abs=TOL)
    assert [g for _, g in got] == [g for _, g in alone]


def test_row_budget_does_not_change_the_scores():
    """One tree per row and all trees in one row give the same answers (the mask keeps trees apart)."""
    s = _session("gemma3", "hf", "sdpa")
    pairs = _pairs(1)
    by = {}
    for budget in (1, 10_000):
        out = [None] * len(pairs)
        for pack in pack_trees(pairs, row_tokens=budget)[0]:
            for i, res in tree_results(pack, s.backend.score_tree(pack)):
                out[i] = res
        by[budget] = out
    assert [x for x, _ in by[1]] == pytest.approx([x for x, _ in by[10_000]], abs=TOL)


@pytest.mark.parametrize("mutation", ["siblings", "positions", "window"])
def test_a_wrong_mask_is_caught(monkeypatch, mutation):
    """The equality test above fails when a continuation sees its siblings, when positions run on instead of
    restarting, or when Gemma 3's sliding layers lose their window."""
    from engine.engines import packing

    real = packing.TreePack.mask
    if mutation == "siblings":
        def mask(self, window=None):
            idx = torch.arange(self.num_tokens)
            return (self.tree[:, None] == self.tree[None, :]) & (idx[None, :] <= idx[:, None])
        monkeypatch.setattr(packing.TreePack, "mask", mask)
    elif mutation == "window":
        monkeypatch.setattr(packing.TreePack, "mask", lambda self, window=None: real(self, None))
    else:
        real_row = packing._row

        def row(trees, device):
            p = real_row(trees, device)
            p.positions = torch.arange(p.num_tokens)
            return p
        monkeypatch.setattr(packing, "_row", row)
    s = _session("gemma3", "hf", "sdpa")
    pairs = _pairs()
    got = [ll for ll, _ in s.loglikelihood(pairs, lambda m: None)]
    alone = [s.padded_loglikelihood([p], lambda m: None)[0][0] for p in pairs]
    assert got != pytest.approx(alone, abs=TOL)

"""lm-evaluation-harness over the trial contract: `SessionLM` is an lm-eval `TemplateLM` whose requests run on
the trial's own session (its quantization, KV cache, attention and precision applied), through the two task
capabilities an engine declares (`Engine.task_requests`): `TrialSession.loglikelihood` (sum of log p of a
continuation's tokens after a context, and whether each was the argmax) and `TrialSession.generate_greedy`
(greedy tokens until a stop string; all of a task's requests at once through the session's `generate_greedy_many`).
lm-eval itself builds the requests, picks answers and aggregates metrics.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from lm_eval.api.model import TemplateLM

Say = Callable[[str], None]


class SessionLM(TemplateLM):
    """lm-eval's model API on a `TrialSession`. `max_length`: the model's positions (longer inputs are cut on
    the left, as lm-eval's own HF model does); `max_gen_toks`: generation's default budget."""

    backend = "causal"

    def __init__(self, session: Any, max_length: int, say: Optional[Say] = None, max_gen_toks: int = 32):
        super().__init__()
        self.session = session
        self.tok = session.tokenizer
        self._max_length = int(max_length)
        self.max_gen_toks = int(max_gen_toks)
        self.say = say or (lambda m: None)

    @property
    def eot_token_id(self) -> int:
        eos = self.tok.eos_token_id
        return int(eos if eos is not None else 0)

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        # A task's text starts with the tokenizer's own leading special tokens, as lm-eval's HF model adds
        # them (Gemma is trained with a BOS first and scores far worse without it); SmolLM2 adds none.
        prefix = getattr(self.tok, "prefix_ids", []) if add_special_tokens is not False else []
        return list(prefix) + list(self.tok.encode(string))

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(list(tokens))

    def token_pairs(self, requests) -> list[tuple[list[int], list[int]]]:
        """(context, continuation) token ids of lm-eval's loglikelihood requests, in their order; a context longer
        than `max_length` is cut on the left."""
        pairs = []
        for _, ctx, cont in requests:
            keep = self._max_length + 1  # the last token is only a target
            whole = (list(ctx) + list(cont))[-keep:]
            pairs.append((whole[: len(whole) - len(cont)], list(cont)))
        return pairs

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = self.token_pairs(requests)
        # Longest first (lm-eval's own HF model orders its batches so too): a session's batches are right-padded
        # to their longest pair, and a task's requests come in document order, so sorting pads far less -- x1.8 on
        # ARC-Easy / SciQ / PIQA with SmolLM2 (BENCHMARKS.md). Answers come back in the requests' order.
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        scored = self.session.loglikelihood([pairs[i] for i in order], self.say)
        out: list = [None] * len(pairs)
        for i, res in zip(order, scored):
            out[i] = res
        for (key, _, _), res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-string log-likelihood in windows of `max_length` (lm-eval's rolling windows)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        results = []
        for (string,) in [r.args for r in requests]:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self._max_length, context_len=1)]
            scores = self.session.loglikelihood([(list(c), list(t)) for c, t in windows], self.say)
            results.append(sum(s for s, _ in scores))
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Every request at once through the session's `generate_greedy_many` (an engine that starts a process per
        call starts it once); the answer is cut before the first stop string (lm-eval's convention)."""
        todo = []
        for context, gen_kwargs in (r.args for r in requests):
            kw = dict(gen_kwargs or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", self.max_gen_toks))
            todo.append((self.tok_encode(context)[-(self._max_length - max_new):], max_new, until))
        answers = self.session.generate_greedy_many(todo, self.say)
        out = []
        for (context, gen_kwargs), (_, _, until), ids in zip((r.args for r in requests), todo, answers):
            text = self.tok_decode(ids)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def offline_env() -> None:
    """No hub: datasets and models only from local files."""
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[k] = "1"

"""Fidelity metrics (engine/measure/fidelity.py) against an independent float64 numpy computation on known
distributions: KL mean / stderr / p99 / p99.9 / max, the same-top-1 rate and its stderr, and the ppl ratio
with its error, as llama.cpp's `--kl-divergence` reports them."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.measure.fidelity import compute_reference, fidelity, fidelity_from_topk

W, T, V = 3, 400, 48  # windows, tokens per window, vocabulary: 3 x 399 positions


class FixedLogits:
    """A backend whose logits are given: window i of `windows` scores to `logits[i]` [T, V]."""

    def __init__(self, windows: torch.Tensor, logits: torch.Tensor):
        self.windows, self.logits = windows, logits

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        (i,) = [k for k, w in enumerate(self.windows) if torch.equal(w, input_ids[0])]
        return self.logits[i][None]


@pytest.fixture(scope="module")
def known():
    """Reference logits, and a candidate = reference + small noise everywhere + large noise at a few positions
    (a quantization's rare broken positions: they set p99.9 and max)."""
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, V, (W, T), generator=g)
    ref = torch.randn(W, T, V, generator=g, dtype=torch.float64) * 2.0
    cand = ref + 0.15 * torch.randn(W, T, V, generator=g, dtype=torch.float64)
    broken = torch.randint(0, T, (W, 3), generator=g)
    for i in range(W):
        cand[i, broken[i]] += 2.5 * torch.randn(3, V, generator=g, dtype=torch.float64)
    return windows, ref.float(), cand.float()


def independent(windows: torch.Tensor, ref: torch.Tensor, cand: torch.Tensor) -> dict[str, float]:
    """The same metrics from scratch in float64 numpy over the full vocabulary."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp = log_softmax(ref[:, :-1].numpy()).reshape(-1, V)
    lq = log_softmax(cand[:, :-1].numpy()).reshape(-1, V)
    tgt = windows[:, 1:].numpy().reshape(-1)
    n = lp.shape[0]
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    same = (lp.argmax(-1) == lq.argmax(-1)).astype(np.float64)
    p = same.mean()
    d = lp[np.arange(n), tgt] - lq[np.arange(n), tgt]  # log p_ref - log p_cand of the actual next token
    ratio = math.exp(d.mean())
    return {"kl_div_mean": kl.mean(), "kl_div_mean_stderr": kl.std(ddof=1) / math.sqrt(n),
            "kl_div_p99": np.quantile(kl, 0.99), "kl_div_p999": np.quantile(kl, 0.999), "kl_div_max": kl.max(),
            "top1_agreement": p, "top1_agreement_stderr": math.sqrt(p * (1 - p) / (n - 1)),
            "ppl_ratio": ratio, "ppl_ratio_stderr": ratio * d.std(ddof=1) / math.sqrt(n)}


NEW = ("kl_div_mean_stderr", "kl_div_p999", "kl_div_max", "top1_agreement_stderr", "ppl_ratio_stderr")


def test_identical_model_is_zero_everywhere_with_zero_errors(known):
    windows, ref, _ = known
    backend = FixedLogits(windows, ref)
    m = fidelity(backend, windows, compute_reference(backend, windows, topk=V))
    assert {k: m[k] for k in ("kl_div_mean", "kl_div_p99", *NEW)} == {k: 0.0 for k in ("kl_div_mean", "kl_div_p99", *NEW)}
    assert m["top1_agreement"] == 1.0 and m["ppl_ratio"] == 1.0


def test_a_known_perturbation_matches_an_independent_computation(known):
    windows, ref, cand = known
    want = independent(windows, ref, cand)
    stats = compute_reference(FixedLogits(windows, ref), windows, topk=V)  # K = V: the KL is exact, no tail
    got = fidelity(FixedLogits(windows, cand), windows, stats)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-6, rel=1e-6), k
    # the perturbation is visible in every statistic, and the ordering llama.cpp's table shows holds
    assert 0 < got["kl_div_mean_stderr"] < got["kl_div_mean"] < got["kl_div_p99"] < got["kl_div_p999"] <= got["kl_div_max"]
    assert 0.5 < got["top1_agreement"] < 1.0 and got["top1_agreement_stderr"] > 0 and got["ppl_ratio_stderr"] > 0


def test_topk_candidate_gives_the_same_metrics_when_its_topk_covers_the_vocabulary(known):
    """engine=vllm's path (the candidate seen through its prompt log-probs) agrees with the logits path."""
    windows, ref, cand = known
    stats = compute_reference(FixedLogits(windows, ref), windows, topk=V)
    full = fidelity(FixedLogits(windows, cand), windows, stats)
    logq = torch.log_softmax(cand[:, :-1], dim=-1)
    top = torch.topk(logq, V, dim=-1)
    tgt = logq.gather(-1, windows[:, 1:, None]).squeeze(-1)
    got = fidelity_from_topk(top.indices, top.values, tgt, stats)
    for k in ("kl_div_mean", *NEW, "top1_agreement", "ppl_ratio"):
        assert got[k] == pytest.approx(full[k], abs=1e-9, rel=1e-9), k


def test_a_fidelity_run_recorded_before_these_metrics_still_reproduces(tiny_overrides, tracking, monkeypatch, tmp_path):
    """A run logged without the new metrics (as recorded before they existed) reproduces as MATCH: each new
    metric reads "not recorded originally"; the ones it has must still be equal."""
    from experiments.config.compose import expand
    from experiments.run.reproduce import NOT_RECORDED, reproduce
    from experiments.run.trial import execute_trial
    from experiments.tracking.store import Tracker

    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))  # its own fidelity reference
    (spec,) = expand(tiny_overrides + ["sweep_name=t-fid-old", "seed=923", "eval=fidelity"])
    outcome = execute_trial(spec)
    assert set(NEW) <= set(outcome.metrics)
    for k in NEW:
        del outcome.metrics[k]
    Tracker(tracking).log_trial("t-fid-old", spec, outcome)
    cmp = reproduce(spec.config_hash[:12], tracking)
    verdicts = {k: v for k, _, _, v in cmp.rows}
    assert {verdicts[k] for k in NEW} == {NOT_RECORDED}
    assert verdicts["kl_div_mean"] == verdicts["top1_agreement"] == verdicts["ppl_ratio"] == "MATCH"
    assert cmp.deterministic_match


def test_a_fidelity_trial_logs_its_argmax_at_every_position_of_its_windows(tmp_path):
    """eval.fidelity's TOP1_ARTIFACT (optimize's pre-screen reads it): one list per window, the trial's own argmax
    at each scored position -- the same ids the model's logits give on those windows -- under a digest of the
    windows that changes with the text; two configurations of one model compare position by position."""
    import json

    from support import make_trial
    from engine import ModelConfig, WorkloadConfig, load_model, run_engine_trial
    from engine.config import EvalConfig, TextConfig, TimingConfig
    from engine.engines import make_backend
    from engine.pipeline import TOP1_ARTIFACT
    from engine.prompts import corpus_ids, windows
    from experiments.optimize.accuracy import prescreen

    tiny = ModelConfig(name="tiny", path="tiny://llama")
    wl = WorkloadConfig(context_len=24, max_new_tokens=2, batch_size=1, warmup=0, repeats=1)
    trial = make_trial(tiny, eval=EvalConfig(num_windows=3, fidelity=True), workload=wl,
                       timing=TimingConfig(max_repeats=0))
    got = json.loads(run_engine_trial(trial).artifacts[TOP1_ARTIFACT])
    assert [len(w) for w in got["top1"]] == [23, 23, 23]
    lm = load_model(tiny, "sdpa")
    evw = windows(corpus_ids(lm.tokenizer, trial.eval.text), 24, 3)
    backend = make_backend(lm, trial)
    want = [backend.score(w[None])[0, :-1].float().argmax(-1).tolist() for w in evw]
    assert got["top1"] == want
    (tmp_path / "t.txt").write_text("A different text, one sentence after another. " * 200)
    text = TextConfig(kind="file", path=str(tmp_path / "t.txt"))
    other = make_trial(tiny, eval=EvalConfig(num_windows=3, fidelity=True, text=text),
                       workload=wl, timing=TimingConfig(max_repeats=0))
    theirs = json.loads(run_engine_trial(other).artifacts[TOP1_ARTIFACT])
    assert theirs["windows"] != got["windows"] and prescreen(got, theirs) is None
    assert prescreen(got, got).differ == 0
    plain = make_trial(tiny, eval=EvalConfig(num_windows=1), workload=wl, timing=TimingConfig(max_repeats=0))
    assert TOP1_ARTIFACT not in run_engine_trial(plain).artifacts  # perplexity only: nothing to compare

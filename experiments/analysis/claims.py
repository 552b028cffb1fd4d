"""The seed's claims, checked against a sweep (`experiment=seed-claims`): claim | measured here | hardware | holds?

Each claim is one `Claim`: the seed's words, the config groups its measurement needs, and a function that
picks the trials it compares and returns a `Finding`. A claim whose groups no trial has reads
"not measured yet (feature missing)"; one whose trials the sweep lacks reads "not measured (no such trials
in this sweep)". To add a row, append a `Claim` to `CLAIMS`.

Verdicts compare ratios measured here with the seed's ranges (its absolute numbers are for a 7B model on an
H100): "yes" inside the range (or beyond it in the claimed direction), "partly" right direction but short of
it (or one half of a two-part claim), "no" otherwise. A claimed speed-up carries the 95% interval of its
ratio (both trials' intervals, engine/measure/spread.py) and reads "within noise" when that interval
contains x1, whatever the median ratio says. A timed verdict drawn from a trial labelled `unstable` for
machine load reads "not decidable"; one drawn from a spread-flagged trial names it (results.rule_verdict).
Arithmetic claims are checked with the cost model's own formulas and hold on any hardware.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from engine.measure.costmodel import ModelShape

from engine.axes import ATTENTION, BACKEND, BATCHING, KV_CACHE, QUANT, SPECULATIVE

from engine.measure.spread import WITHIN_NOISE

from .results import CONTEXT, TrialRow, axes, compare, counterpart, rule_verdict, speedup

YES, PARTLY, NO = "yes", "partly", "no"
WITHIN = "within noise"  # a claimed gain whose interval contains x1
MISSING = "not measured yet (feature missing)"
ABSENT = "not measured (no such trials in this sweep)"
ARITHMETIC = "any (arithmetic)"


@dataclass
class Finding:
    measured: str
    holds: str
    used: list[TrialRow] = field(default_factory=list)  # the trials compared (for the hardware column)
    hardware: Optional[str] = None  # set for arithmetic claims


class Trials:
    """The finished trials of a sweep, with the lookups claims need."""

    def __init__(self, rows: list[TrialRow]):
        self.all = rows
        self.rows = [r for r in rows if r.finished]
        self.ax = axes(self.rows)

    def has_group(self, group: str) -> bool:
        return any(k.startswith(group + ".") for r in self.all for k in r.params)

    def contexts(self) -> list[int]:
        return sorted({r.context_len for r in self.rows if r.context_len})

    def context_near(self, target: int) -> Optional[int]:
        ctx = self.contexts()
        return min(ctx, key=lambda c: (abs(c - target), -c)) if ctx else None

    def find(self, **where: str) -> list[TrialRow]:
        """Rows whose params match; keys use `__` for dots (kv_cache__mode="off")."""
        conds = {k.replace("__", "."): str(v) for k, v in where.items()}
        return [r for r in self.rows if all(r.params.get(k) == v for k, v in conds.items())]

    def pair(self, base_where: dict[str, str], change: dict[str, object]) -> Optional[tuple[TrialRow, TrialRow]]:
        """(a, b): a matches `base_where`; b is a's counterpart with `change` applied, all else equal.
        Prefers the hf backend (the reference implementation) and fused attention (the stack the seed
        assumes) when several pairs exist."""
        cands = self.find(**base_where)
        cands.sort(key=lambda r: (r.params.get(BACKEND.key) != BACKEND.off, r.params.get(ATTENTION.key) == ATTENTION.off))
        for a in cands:
            b = counterpart(self.rows, a, change, self.ax)
            if b is not None:
                return a, b
        return None


def _range_verdict(r: float, lo: float, partly_above: float = 1.1) -> str:
    if r >= lo:
        return YES
    return PARTLY if r > partly_above else NO


def _interval(base: TrialRow, new: TrialRow, metric: str) -> str:
    """' [95%: x1.10-x1.35, faster]' for the ratio new/base of `metric`, '' where no interval was logged."""
    c = compare(base, new, metric)
    return "" if c is None else f" [95%: x{c.lo:.2f}-x{c.hi:.2f}, {c.verdict}]"


def _gain(holds: str, base: TrialRow, new: TrialRow, metric: str) -> str:
    """A claimed gain judged from its interval: 'within noise' when the interval cannot tell it from x1."""
    c = compare(base, new, metric)
    return WITHIN if c is not None and c.verdict == WITHIN_NOISE else holds


def _mb(x: Optional[float]) -> str:
    return "?" if x is None else f"{x / 1e6:.0f} MB"


# --- measured claims ----------------------------------------------------------------------------------
def _kv_pair(t: Trials) -> tuple[Optional[int], Optional[tuple[TrialRow, TrialRow]]]:
    """(context near 2k, (KV cache off, on) at it, other settings equal) -- what both KV claims compare."""
    ctx = t.context_near(2048)
    return ctx, t.pair({CONTEXT: ctx, KV_CACHE.key: KV_CACHE.off}, {KV_CACHE.key: lambda v: v in ("contiguous", "paged")})


def kv_speedup(t: Trials) -> Optional[Finding]:
    ctx, p = _kv_pair(t)
    if p is None:
        return None
    off, on = p
    r = speedup(off.num("decode_tok_s"), on.num("decode_tok_s"))
    measured = (f"x{r:.1f} decode at context {ctx} ({off.num('decode_tok_s'):.2f} -> {on.num('decode_tok_s'):.2f} tok/s, "
                f"{on.params.get('engine.backend')}/{on.params.get('attention.impl')})" + _interval(off, on, "decode_tok_s"))
    return Finding(measured, _gain(_range_verdict(r, 10, 2), off, on, "decode_tok_s"), [off, on])


def kv_regime(t: Trials) -> Optional[Finding]:
    ctx, p = _kv_pair(t)
    if p is None:
        return None
    off, on = p
    ro, rn = off.tags.get("regime.decode.measured"), on.tags.get("regime.decode.measured")
    if not ro or not rn:
        return None

    def util(r: TrialRow) -> str:
        return f"{100 * (r.num('decode_compute_util') or 0):.0f}% FLOP/s, {100 * (r.num('decode_bw_util') or 0):.0f}% bandwidth"

    measured = f"decode without cache: {ro}-bound ({util(off)}); with: {rn}-bound ({util(on)})"
    holds = YES if (ro, rn) == ("compute", "memory") else (PARTLY if rn == "memory" or ro == "compute" else NO)
    return Finding(measured, holds, [off, on])


def _attention_pair(t: Trials, ctx: int, kv: str = "cached") -> Optional[tuple[TrialRow, TrialRow]]:
    """(eager, fused) at `ctx`, with (`cached`) or without (`off`) KV cache; the hf backend preferred."""
    is_cached = (lambda v: v != "off") if kv == "cached" else (lambda v: v == "off")
    cands = [a for a in t.find(**{CONTEXT: ctx, ATTENTION.key: ATTENTION.off}) if is_cached(KV_CACHE.value(a.params))]
    cands.sort(key=lambda r: r.params.get(BACKEND.key) != BACKEND.off)
    for a in cands:
        p = counterpart(t.rows, a, {ATTENTION.key: lambda v: v in ("sdpa", "flash")}, t.ax)
        if p is not None:
            return a, p
    return None


def flash_speedup(t: Trials) -> Optional[Finding]:
    ctx = max([c for c in t.contexts() if c >= 1024], default=None)
    p = _attention_pair(t, ctx) if ctx else None
    if p is None:
        return None
    eager, fused = p
    r = speedup(eager.num("output_tok_s"), fused.num("output_tok_s"))
    rp = speedup(eager.num("prefill_tok_s"), fused.num("prefill_tok_s"))
    measured = (f"x{r:.2f} end-to-end at context {ctx} ({fused.params.get('attention.impl')} vs eager, "
                f"{fused.params.get('engine.backend')}; prefill x{rp:.2f})" + _interval(eager, fused, "output_tok_s"))
    return Finding(measured, _gain(_range_verdict(r, 2), eager, fused, "output_tok_s"), [eager, fused])


def flash_memory(t: Trials) -> Optional[Finding]:
    ctx = max([c for c in t.contexts() if c >= 1024], default=None)
    if not ctx:
        return None
    # the attention scratch itself (from an engine that records it), and the whole process's peak: rows of an
    # engine that records the scratch first, then the reference engine's, then the others'
    attn, peak = None, None
    cands = t.find(**{CONTEXT: ctx, ATTENTION.key: ATTENTION.off})
    cands.sort(key=lambda r: (not r.num("attn_peak_bytes"), r.params.get(BACKEND.key) != BACKEND.off))
    for a in cands:
        b = counterpart(t.rows, a, {ATTENTION.key: lambda v: v in ("sdpa", "flash")}, t.ax)
        if b is None:
            continue
        if attn is None and a.num("attn_peak_bytes") and b.num("attn_peak_bytes"):
            attn = (a, b)
        if peak is None and a.num("peak_mem_bytes") and b.num("peak_mem_bytes"):
            peak = (a, b)
    if attn is None and peak is None:
        return None
    parts, used, holds = [], [], NO
    if attn is not None:
        a, b = attn
        r = a.num("attn_peak_bytes") / b.num("attn_peak_bytes")
        parts.append(f"attention scratch {_mb(a.num('attn_peak_bytes'))} eager vs {_mb(b.num('attn_peak_bytes'))} fused "
                     f"(/{r:.0f}, {a.params.get('engine.backend')})")
        used += [a, b]
        holds = YES if r >= 2 else (PARTLY if r > 1.1 else NO)
    if peak is not None:
        a, b = peak
        r = a.num("peak_mem_bytes") / b.num("peak_mem_bytes")
        parts.append(f"process peak {_mb(a.num('peak_mem_bytes'))} vs {_mb(b.num('peak_mem_bytes'))} "
                     f"(/{r:.2f}, {a.params.get('engine.backend')})")
        used += [a, b]
        if attn is None:
            holds = YES if r >= 2 else (PARTLY if r > 1.05 else NO)
    return Finding(f"at context {ctx}: " + "; ".join(parts), holds, used)


def flash_short(t: Trials) -> Optional[Finding]:
    ctx = min([c for c in t.contexts() if c <= 512], default=None)
    p = _attention_pair(t, ctx) if ctx else None
    if p is None:
        return None
    eager, fused = p
    r = speedup(eager.num("output_tok_s"), fused.num("output_tok_s"))
    measured = (f"x{r:.2f} end-to-end at context {ctx}, batch {eager.batch_size}" + (" (fused slower here)" if r < 0.9 else "")
                + _interval(eager, fused, "output_tok_s"))
    return Finding(measured, YES if r < 1.2 else (PARTLY if r < 1.5 else NO), [eager, fused])


def flash_needs_kv(t: Trials) -> Optional[Finding]:
    ctx = max([c for c in t.contexts() if c >= 1024], default=None)
    if not ctx:
        return None
    on, off = _attention_pair(t, ctx, "cached"), _attention_pair(t, ctx, "off")
    if on is None or off is None:
        return None
    r_on = speedup(on[0].num("output_tok_s"), on[1].num("output_tok_s"))
    r_off = speedup(off[0].num("output_tok_s"), off[1].num("output_tok_s"))
    measured = (f"fused vs eager at context {ctx}: x{r_off:.2f} without KV cache{_interval(*off, 'output_tok_s')}, "
                f"x{r_on:.2f} with it{_interval(*on, 'output_tok_s')}")
    # "won't be visible": the gain without a cache is no larger than with it (within noise)
    return Finding(measured, YES if r_off <= r_on * 1.05 else NO, [*off, *on])


def _quant_claim(levels: tuple[str, ...], speed: tuple[float, float], drop_pct: tuple[float, float]):
    def measure(t: Trials) -> Optional[Finding]:
        for level in levels:
            for q in t.find(**{QUANT.key: level}):
                base = counterpart(t.rows, q, {QUANT.key: QUANT.off}, t.ax)
                if base is None:
                    continue
                r = speedup(base.num("output_tok_s"), q.num("output_tok_s"))
                if base.num("ppl") and q.num("ppl"):
                    drop = 100 * (q.num("ppl") / base.num("ppl") - 1)
                    acc = f", ppl {base.num('ppl'):.3f} -> {q.num('ppl'):.3f} ({drop:+.1f}%)"
                else:
                    drop, acc = None, ""
                measured = f"{level}: x{r:.2f} output tok/s at context {q.context_len}{_interval(base, q, 'output_tok_s')}{acc}"
                fast = r >= speed[0] and _gain(YES, base, q, "output_tok_s") == YES
                accurate = drop is not None and drop <= drop_pct[1]
                holds = YES if fast and accurate else (PARTLY if fast or accurate else NO)
                return Finding(measured, holds, [base, q])
        return None

    return measure


def naive_w8a8(t: Trials) -> Optional[Finding]:
    for q in t.find(**{QUANT.key: "int8-dynamic"}):
        base = counterpart(t.rows, q, {QUANT.key: QUANT.off}, t.ax)
        if base is None or not base.num("ppl") or not q.num("ppl"):
            continue
        drop = 100 * (q.num("ppl") / base.num("ppl") - 1)
        measured = f"int8-dynamic (no outlier handling): ppl {base.num('ppl'):.3f} -> {q.num('ppl'):.3f} ({drop:+.1f}%)"
        return Finding(measured, YES if drop > 10 else (PARTLY if drop > 3 else NO), [base, q])
    return None


def quant_long_context(t: Trials) -> Optional[Finding]:
    """The ppl increase of one quantization level at its shortest and longest measured context."""
    by_level: dict[str, dict[int, tuple[float, TrialRow, TrialRow]]] = {}
    for q in t.rows:
        lv = QUANT.value(q.params)
        if lv in (None, QUANT.off) or not q.num("ppl"):
            continue
        base = counterpart(t.rows, q, {QUANT.key: QUANT.off}, t.ax)
        if base is None or not base.num("ppl"):
            continue
        by_level.setdefault(lv, {})[q.context_len or 0] = (100 * (q.num("ppl") / base.num("ppl") - 1), base, q)
    for lv, drops in by_level.items():
        if len(drops) < 2:
            continue
        lo, hi = min(drops), max(drops)
        measured = f"{lv}: ppl {drops[lo][0]:+.2f}% at context {lo}, {drops[hi][0]:+.2f}% at {hi}"
        return Finding(measured, YES if drops[hi][0] > drops[lo][0] else NO, [*drops[lo][1:], *drops[hi][1:]])
    return None


def speculative_formula(t: Trials) -> Optional[Finding]:
    rows = [r for r in t.rows if r.num("tokens_per_step") and r.num("predicted_tokens_per_step")]
    if not rows:
        return None
    r = rows[0]
    got, want = r.num("tokens_per_step"), r.num("predicted_tokens_per_step")
    measured = (f"{got:.2f} tokens/step vs formula {want:.2f} ({_spec_desc(r)}, "
                f"alpha={r.num('acceptance_rate') or 0:.2f})")
    err = abs(got / want - 1)
    return Finding(measured, YES if err <= 0.1 else (PARTLY if err <= 0.25 else NO), [r])


def _speculative_on(v: Optional[str]) -> bool:
    return v is not None and v != SPECULATIVE.off


def _spec_desc(r: TrialRow) -> str:
    """`prompt-lookup k=4, repeat workload, context 256`: what a speculative number was measured on."""
    method = (SPECULATIVE.value(r.params) or "?")
    extra = f" ({r.params.get('speculative.draft_layers')} layers)" if method == "self-draft" else ""
    return (f"{method}{extra} k={r.params.get('speculative.k', '?')}, "
            f"{r.params.get('workload.prompt_style', 'window')} workload, context {r.context_len}")


def speculative_speedup(t: Trials) -> Optional[Finding]:
    for base in t.find(**{SPECULATIVE.key: SPECULATIVE.off}):
        s = counterpart(t.rows, base, {SPECULATIVE.key: _speculative_on}, t.ax)
        if s is None:
            continue
        r = speedup(base.num("output_tok_s"), s.num("output_tok_s"))
        measured = (f"x{r:.2f} output tok/s ({_spec_desc(s)}: {base.num('output_tok_s'):.1f} -> "
                    f"{s.num('output_tok_s'):.1f} tok/s, alpha={s.num('acceptance_rate') or 0:.2f})"
                    + _interval(base, s, "output_tok_s"))
        return Finding(measured, _gain(_range_verdict(r, 2), base, s, "output_tok_s"), [base, s])
    return None


def continuous_batching(t: Trials) -> Optional[Finding]:
    for base in t.find(**{BATCHING.key: BATCHING.off}):
        c = counterpart(t.rows, base, {BATCHING.key: "continuous"}, t.ax)
        if c is None:
            continue
        r = speedup(base.num("output_tok_s"), c.num("output_tok_s"))
        return Finding(f"continuous vs static: x{r:.2f} output tok/s (static = {100 / r:.0f}% of continuous)"
                       + _interval(base, c, "output_tok_s"), _gain(_range_verdict(r, 1 / 0.7), base, c, "output_tok_s"),
                       [base, c])
    return None


MULTI_TURN, PREFIX_CACHING = "workload.kind", "kv_cache.prefix_caching"


def _on(v: Optional[str]) -> bool:
    return str(v).lower() == "true"


def reprompting(t: Trials) -> Optional[Finding]:
    """Multi-turn conversations with the cached state (prefix caching) vs re-prompting from scratch, all
    else equal (continuous batching preferred): prompt tokens computed and TTFT of the last turn (the
    longest history); a capacity search's trials also compare their max rate at the SLO."""
    scratch = [r for r in t.find(**{MULTI_TURN: "multi-turn"}) if not _on(r.params.get(PREFIX_CACHING))]
    scratch.sort(key=lambda r: r.params.get(BATCHING.key) != "continuous")
    for off in scratch:
        on = counterpart(t.rows, off, {PREFIX_CACHING: _on}, t.ax)
        if on is None or None in (off.num("prefill_tokens_last_turn"), on.num("prefill_tokens_last_turn"),
                                  off.num("ttft_ms_last_turn"), on.num("ttft_ms_last_turn")):
            continue
        p_off, p_on = off.num("prefill_tokens_last_turn"), on.num("prefill_tokens_last_turn")
        t_off, t_on = off.num("ttft_ms_last_turn"), on.num("ttft_ms_last_turn")
        tokens = p_off / p_on if p_on else float("inf")
        ttft = t_off / t_on if t_on else float("inf")
        turns = off.params.get("workload.turns", "?")
        measured = (f"last of {turns} turns ({off.params.get(BATCHING.key)} batching): re-prompting computes "
                    f"{p_off:.0f} prompt tokens vs {p_on:.0f} with cached state (x{tokens:.1f}); TTFT {t_off:.0f} vs "
                    f"{t_on:.0f} ms (x{ttft:.2f})")
        gains = [ttft]
        r_off, r_on = off.num("max_rate_at_slo"), on.num("max_rate_at_slo")
        if r_off is not None and r_on is not None:  # capacity search: the metrics are at each one's found rate
            measured += f"; max rate at SLO {r_off:.3g} vs {r_on:.3g} conversations/s (metrics at each found rate)"
            gains.append(r_on / r_off if r_off else (float("inf") if r_on else 1.0))
        holds = YES if tokens > 1.1 and max(gains) > 1.1 else PARTLY if tokens > 1.1 or max(gains) > 1.1 else NO
        return Finding(measured, holds, [off, on])
    return None


# --- arithmetic claims (the cost model's formulas) ------------------------------------------------------
def arith_attention_ops(_: Trials) -> Finding:
    total = sum(n * n for n in range(1, 1001))
    return Finding(f"sum of n^2 for n = 1..1000 = {total / 1e6:.1f}M", YES if abs(total / 333e6 - 1) < 0.01 else NO,
                   hardware=ARITHMETIC)


def arith_kv_size(_: Trials) -> Finding:
    shape = ModelShape(num_layers=32, hidden=4096, intermediate=11008, num_heads=32, num_kv_heads=32, head_dim=128, vocab=32000)
    per_sample = shape.kv_bytes_per_token(2) * 32768
    per_layer = per_sample / shape.num_layers
    return Finding(f"K+V, fp16: {per_sample / 1e9:.1f} GB per sample ({per_layer / 1e6:.0f} MB per layer)",
                   NO if per_sample > 1e9 else YES, hardware=ARITHMETIC)


def right_size_first(t: Trials) -> Optional[Finding]:
    """"Right-size before you tune", judged where the sweep ran two models under the same configurations
    (model is an axis, `experiment=right-size`). Per task, the smaller model's score minus the larger's with
    its 95% interval (advice.task_difference, on the pair at the larger model's slowest configuration): the
    smaller model suffices where no interval lies wholly below 0. The right-size gain is its output tok/s over
    the larger model's at that configuration; the tuning gain is the larger model's fastest configuration
    over that slowest one. "yes": the smaller model suffices and right-sizing alone gains at least what tuning
    the larger model does; "partly": it suffices and is faster, but tuning gains more; "no": the larger model
    is needed (right-sizing is not open on these tasks) or the smaller model is not faster."""
    from .advice import _tasks, task_differences

    by_model: dict[str, list[TrialRow]] = {}
    for r in t.rows:
        if r.num("output_tok_s") and r.params.get("model.name"):
            by_model.setdefault(r.params["model.name"], []).append(r)
    if len(by_model) < 2:
        return None
    # the larger model: the most weight bytes of any of its trials (its widest dtype, unquantized)
    size = {m: max(r.num("weights_bytes") or 0 for r in rs) for m, rs in by_model.items()}
    large_name = max(size, key=size.get)
    changes = {k: (lambda v: True) for k in t.ax if k.startswith("model.") and k != "model.dtype"}
    changes["model.name"] = lambda v: v is not None and v != large_name and v in by_model
    for base in sorted(by_model[large_name], key=lambda r: r.num("output_tok_s")):
        small = counterpart(t.rows, base, changes, t.ax)
        if small is not None:
            break
    else:
        return None
    tuned = max(by_model[large_name], key=lambda r: r.num("output_tok_s"))
    sname = small.params["model.name"]
    gain, tune = speedup(base.num("output_tok_s"), small.num("output_tok_s")), speedup(
        base.num("output_tok_s"), tuned.num("output_tok_s"))
    tasks = [x for x in _tasks(small) if x in _tasks(base)]
    if not tasks:
        return None  # right-sizing needs accuracy: eval=tasks
    cells, needed = task_differences(small, base, tasks)
    measured = (f"{sname} - {large_name} per task (95%): {'; '.join(cells)}; right-size: {sname} x{gain:.2f} output "
                f"tok/s of {large_name} at {large_name}'s slowest configuration{_interval(base, small, 'output_tok_s')}; "
                + (f"tuning {large_name}: not measured (one configuration of it in this sweep)" if tuned is base else
                   f"tuning {large_name}: x{tune:.2f} (its fastest configuration{_interval(base, tuned, 'output_tok_s')})"))
    used = [base, small] + ([tuned] if tuned is not base else [])
    if needed:
        return Finding(measured + f"; the larger model is needed for {', '.join(needed)}", NO, used)
    if gain <= 1:
        return Finding(measured, NO, used)
    # without a second configuration of the larger model, right-sizing is measured but not weighed against tuning
    holds = _gain(YES if gain >= tune and tuned is not base else PARTLY, base, small, "output_tok_s")
    return Finding(measured, holds, used)


def arith_attention_matrix(_: Trials) -> Finding:
    fp16 = 4096 * 4096 * 2
    return Finding(f"4096 x 4096 scores: {fp16 / 2**20:.0f} MiB in fp16 ({2 * fp16 / 2**20:.0f} MiB in fp32); "
                   f"x32 heads = {32 * fp16 / 2**30:.0f} GiB fp16 per layer", PARTLY, hardware=ARITHMETIC)


def arith_kv_read_time(_: Trials) -> Finding:
    t = 500e6 / 1e12
    return Finding(f"500 MB / 1 TB/s = {t * 1e3:.2f} ms", YES if abs(t - 0.5e-3) < 1e-5 else NO, hardware=ARITHMETIC)


def arith_speculative_example(_: Trials) -> Finding:
    a, k = 0.7, 5
    v = (1 - a ** (k + 1)) / (1 - a)
    return Finding(f"(1 - 0.7^6) / (1 - 0.7) = {v:.2f} tokens per target step", YES if abs(v - 2.5) < 0.15 else PARTLY,
                   hardware=ARITHMETIC)


@dataclass(frozen=True)
class Claim:
    name: str
    seed: str  # what the seed says
    measure: Callable[[Trials], Optional[Finding]]
    needs: tuple[str, ...] = ()  # config groups the measurement needs


CLAIMS: tuple[Claim, ...] = (
    Claim("kv-speedup", "KV cache at 2k context: 3-5 -> 50-80 tok/s (x10-27 decode)", kv_speedup, ("kv_cache",)),
    Claim("kv-regime", "KV cache shifts decode from compute-bound to memory-bandwidth-bound", kv_regime, ("kv_cache",)),
    Claim("flash-speedup", "Flash attention: 2-4x end-to-end speedup at 1k-16k context", flash_speedup, ("attention",)),
    Claim("flash-memory", "Flash attention cuts attention memory (2-4x longer contexts fit)", flash_memory, ("attention",)),
    Claim("flash-short", "Flash attention gives nothing when batch is small and context short", flash_short, ("attention",)),
    Claim("flash-needs-kv", "Skip step 1 (KV cache) and step 3 (flash) won't be visible", flash_needs_kv, ("kv_cache", "attention")),
    Claim("quant-int8-weight", "Weight-only INT8: ~1.5-2x speedup, <1% accuracy drop",
          _quant_claim(("int8-weight",), (1.5, 2), (0, 1)), ("quant",)),
    Claim("quant-int8-careful", "Weight + activation INT8 with care (LLM.int8): ~2-3x speedup, 1-3% accuracy drop",
          _quant_claim(("bnb-int8",), (2, 3), (1, 3)), ("quant",)),
    Claim("quant-naive-w8a8", "Naive activation quantization crashes accuracy", naive_w8a8, ("quant",)),
    Claim("quant-int4", "INT4: ~3-4x speedup, 3-10% accuracy drop", _quant_claim(("int4-weight", "bnb-nf4", "bnb-fp4"), (3, 4), (3, 10)), ("quant",)),
    Claim("quant-long-context", "Quantized models degrade more at long context than short", quant_long_context, ("quant",)),
    Claim("spec-formula", "Speculative: tokens per target step = (1 - a^(k+1)) / (1 - a)", speculative_formula, ("speculative",)),
    Claim("spec-speedup", "Speculative decoding: 2-3x net speedup", speculative_speedup, ("speculative",)),
    Claim("continuous-batching", "Static batching leaves 30-60% of throughput on the floor (continuous: x1.4-2.5)",
          continuous_batching, ("batching",)),
    Claim("reprompting", "Re-running the full prompt every turn when a cached conversation state would do is doing the "
          "same work twice (re-prompting costs prefill tokens and TTFT every turn)", reprompting, ("batching",)),
    Claim("right-size", "Right-size before you tune: a model that handles the task at a fraction of the size beats "
          "optimizing the larger one", right_size_first),
    Claim("arith-attention-ops", "No cache, 1000 tokens: ~333M attention operations in all", arith_attention_ops),
    Claim("arith-kv-size", "KV cache at 32k context, 32 layers x 32 heads x 128 dims: ~500 MB per sample", arith_kv_size),
    Claim("arith-attention-matrix", "4096^2 attention matrix: 64 MB fp16 per head per layer, 2 GB for 32 heads", arith_attention_matrix),
    Claim("arith-kv-read", "Reading 500 MB per token at 1 TB/s costs half a millisecond", arith_kv_read_time),
    Claim("arith-spec-example", "alpha = 0.7, k = 5: roughly 2.5 tokens per target step", arith_speculative_example),
)

# the accuracy claims judged from task accuracy (eval.tasks): experiments/analysis/accuracy_claims.py
from .accuracy_claims import ACCURACY  # noqa: E402


def _finding(measure):
    return lambda t: (lambda got: Finding(*got) if got else None)(measure(t))


CLAIMS = CLAIMS + tuple(Claim(name, seed, _finding(m), needs) for name, seed, m, needs in ACCURACY)
# Claims read from no timing (memory, perplexity, task accuracy, counted tokens): machine load cannot bias
# them, so the stability rule (results.rule_verdict) leaves their verdicts alone.
UNTIMED = frozenset({"flash-memory", "quant-naive-w8a8", "quant-long-context", "spec-formula"}
                    | {name for name, *_ in ACCURACY})


@dataclass
class ClaimRow:
    name: str
    claim: str
    measured: str
    hardware: str
    holds: str


def evaluate(rows: list[TrialRow], claims: tuple[Claim, ...] = CLAIMS) -> list[ClaimRow]:
    t = Trials(rows)
    out = []
    for c in claims:
        missing = [g for g in c.needs if not t.has_group(g)]
        if missing:
            out.append(ClaimRow(c.name, c.seed, f"needs {', '.join(missing)}", "-", MISSING))
            continue
        f = c.measure(t)
        if f is None:
            out.append(ClaimRow(c.name, c.seed, "-", "-", ABSENT))
            continue
        hw = f.hardware or "; ".join(dict.fromkeys(r.hardware() for r in f.used)) or "-"
        holds = f.holds if c.name in UNTIMED else rule_verdict(f.holds, f.used, decided=f.holds != WITHIN)
        out.append(ClaimRow(c.name, c.seed, f.measured, hw, holds))
    return out


def to_markdown(rows: list[ClaimRow]) -> str:
    out = ["| claim | measured here | hardware | holds? |", "|---|---|---|---|"]
    out += [f"| {r.claim} | {r.measured} | {r.hardware} | {r.holds} |" for r in rows]
    return "\n".join(out)

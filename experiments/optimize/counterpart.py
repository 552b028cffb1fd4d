"""Every answer gets a deployable line. Where the final configuration runs on an in-process engine (hf, native:
measured, not served), `optimize` builds its served counterpart -- the same model and settings on llama.cpp's own
server (`python -m llama_cpp.server`), the closest values it has (int8 weights -> the Q8_0 GGUF, int4 -> Q4_0,
fused attention (sdpa) -> its flash attention, prompt-lookup drafting, the threads) -- measures it as a served trial on the final trial's own
prompt and output lengths, one request at a time (the in-process step's batch of one, through HTTP), and names
the ratio between the two on the objective's timing. Its printed command is then launched and checked against the
server's defaults like any served final (verify.py), so the user leaves with a command and its measured cost
against the in-process winner."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from engine.config import TrialConfig

from ..config.compose import SweepError
from ..config.spec import TrialSpec
from .dispatch import TrialMeasure
from .measurement import Measurement, Point, Request
from .objective import Objective, metric_ratio
from .space import read_space

# an in-process quantization -> the GGUF weight type nearest to it (the same bits a weight; llama.cpp quantizes in
# blocks of 32 with one scale each, ours per channel or per group: close, not equal -- the counterpart is not gated)
GGUF_OF = {"none": "none", "int8-weight": "gguf-q8_0", "int8-dynamic": "gguf-q8_0", "bnb-int8": "gguf-q8_0",
           "int4-weight": "gguf-q4_0", "bnb-nf4": "gguf-q4_0", "bnb-fp4": "gguf-q4_0"}
KEPT = ("model", "model.", "engine.threads", "tracking.", "cluster.", "slo.")  # overrides the counterpart shares
REQUESTS = 8  # requests per run: one in flight at a time


@dataclass(frozen=True)
class Counterpart:
    overrides: tuple[str, ...]
    spec: Optional[TrialSpec] = None
    measurement: Optional[Measurement] = None
    ratio_metric: str = ""
    ratio: object = None  # engine.measure.spread.Ratio: the counterpart vs the in-process final (> 1: served better)
    notes: tuple[str, ...] = ()
    metrics: dict = field(default_factory=dict)


def served_usage() -> list[str]:
    """The overrides that put a trial on the served engine whose weights are GGUF_OF's levels (llama.cpp's server,
    `server=llamacpp`: it starts in seconds on a CPU), asked of the engine registry; [] where none declares them."""
    from engine import engines
    from engine.served.session import ServedEngine

    want = set(GGUF_OF.values())
    for e in engines.all_engines():
        levels = e.support.get("quant.level")
        if isinstance(e, ServedEngine) and e.serving_usage and levels and all(levels.accepts(v) for v in want):
            return e.serving_usage.split()
    return []


def _kept(override: str) -> bool:
    key = override.split("=", 1)[0].lstrip("+~")
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in KEPT)


def counterpart_overrides(fixed: list[str], point: Point, trial: TrialConfig, experiment: str) -> list[str]:
    """The served counterpart of the final trial as overrides: what the final shares with any engine (model, threads,
    tracking, SLO), its settings mapped to the server's nearest values, and a serving workload of the final's own
    lengths with one request in flight (TPOT and TTFT comparable with the in-process step's)."""
    shared = [o for o in fixed if _kept(o)] + [f"{k}={v}" for k, v in point.items() if _kept(f"{k}=")]
    w = trial.workload
    out = shared + served_usage() + [f"sweep_name={experiment}", "eval=none",
                    f"quant={GGUF_OF.get(trial.quant.level, 'none')}",
                    f"speculative={'prompt-lookup' if trial.speculative.method == 'prompt-lookup' else 'off'}",
                    "workload=serving-burst", f"workload.num_requests={REQUESTS}", "workload.max_concurrency=1",
                    "workload.prefix_len=0", "workload.input_len.dist=fixed",
                    f"workload.input_len.value={w.context_len}", "workload.output_len.dist=fixed",
                    f"workload.output_len.value={max(2, w.max_new_tokens)}", f"workload.text.kind={w.text.kind}"]
    if trial.attention.impl in ("sdpa", "flash"):  # a fused attention kernel: llama.cpp's is its flash attention
        out.append("attention=flash")
    return out


def served_counterpart(disp: TrialMeasure, final_point: Point, final: TrialSpec, objective: Objective,
                       echo: Callable[[str], None]) -> Counterpart:
    """Measure the served counterpart of the in-process `final` and compare it on the objective's timing terms
    (TPOT where the objective has none a served trial logs); a Counterpart with notes only where it cannot run."""
    experiment = disp.sweep_name
    overrides = tuple(counterpart_overrides(disp.space.fixed, final_point, final.trial, experiment))
    try:
        space = read_space(list(overrides))
        spec = space.trial({})
    except SweepError as e:  # llama.cpp not installed here, a model it cannot convert, ...
        return Counterpart(overrides, notes=("no served counterpart of the in-process final configuration: "
                                             + "; ".join(str(p) for p in getattr(e, "found", None) or e.problems),))
    echo(f"the final configuration runs in-process (engine {final.trial.engine.backend}); measuring its served "
         f"counterpart on llama.cpp's server: " + " ".join(o for o in overrides if not _kept(o)))
    measure = TrialMeasure(space, experiment, disp.tracking, disp.parent_run_id, disp.rounds, disp.command,
                           disp.in_process, echo)
    [[served]], [[mine]] = measure([Request(({},))]), disp([Request((dict(final_point),))])
    if not served.ok:
        said = served.error.split("\nTraceback (most recent call last)")[0].rstrip()  # what it said, not where
        return Counterpart(overrides, spec, served, notes=(f"the served counterpart failed: {said}",))
    terms = [t for t in objective.terms if t.metric in ("tpot_ms_p50", "ttft_ms_p50")] or [
        t for t in Objective.parse("tpot").terms]
    t = terms[0]
    r = metric_ratio(mine, served, t.metric, t.higher_is_better) if mine.ok else None
    metrics = {"counterpart_" + t.metric: served.metrics.get(t.metric, 0.0)}
    if r is None:
        return Counterpart(overrides, spec, served, t.metric, None, (
            f"served counterpart measured ({t.label} {served.metrics.get(t.metric, 0):.3g}); no ratio to the "
            f"in-process final: {mine.error or 'its ' + t.metric + ' is missing'}",), metrics)
    metrics.update({f"counterpart_{t.metric}_ratio": r.value, f"counterpart_{t.metric}_ratio_ci_lo": r.lo,
                    f"counterpart_{t.metric}_ratio_ci_hi": r.hi})
    note = (f"served counterpart (llama.cpp's server, config_hash {served.config_hash[:12]}): {t.label} "
            f"{served.metrics.get(t.metric, 0):.3g} vs {mine.metrics.get(t.metric, 0):.3g} in-process, x{r.value:.2f} "
            f"[{r.lo:.2f}, {r.hi:.2f}] of the in-process final (> 1: the server is better; two trials, each its own "
            f"interval, not an interleaved pair; the same prompt and output lengths, one request at a time; its "
            f"outputs are not gated: its GGUF quantizes differently)")
    return Counterpart(overrides, spec, served, t.metric, r, (note,), metrics)

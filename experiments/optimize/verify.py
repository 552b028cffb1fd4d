"""The deliverable checked: where the final configuration runs on a served engine, `optimize` ends by launching
exactly the deploy command it prints (a fresh process, nothing shared with the trials) beside the engine's default
launch (the weights and no tuning flags), drives the workload through both in interleaved rounds
(engine/served/verify.py), and reports the paired ratio of goodput at the SLO -- "x1.6 [1.4, 1.8] goodput vs the
defaults, verified by launching the printed command" -- with TTFT and TPOT beside it."""
from __future__ import annotations

from typing import Callable, Optional

from engine import engines
from engine.config import EngineError, TrialConfig
from engine.measure.spread import paired_ratio
from engine.served.session import ServedEngine
from engine.served.verify import describe_rounds, measure_launches

# goodput is requests meeting the SLO per second of the run: a server that cuts requests short ends its run sooner,
# so the share of the requests sent that were answered in full within the SLO stands beside it
VERIFY_METRICS = (("goodput", True, "goodput at the SLO"), ("slo_attainment", True, "requests answered within the SLO"),
                  ("ttft_ms_p50", False, "TTFT p50"), ("tpot_ms_p50", False, "TPOT p50"))


def verify_deploy(trial: TrialConfig, rounds: int, echo: Callable[[str], None]) -> tuple[Optional[str], dict[str, float]]:
    """(the note, metrics) of launching `trial`'s printed deploy command against its engine's defaults; (None, {})
    where the engine is not served (an in-process engine's deliverable is its configuration)."""
    eng = engines.get(trial.engine.backend)
    if not isinstance(eng, ServedEngine):
        return None, {}
    try:
        weights = eng.weights_file(trial)
        tokenizer = eng.load(trial, echo).tokenizer
        launches = [eng.deploy_launch(trial, weights), eng.default_launch(trial, weights)]
        echo(f"verifying the deploy command: it and the defaults launched fresh, {rounds} interleaved rounds")
        tuned, default = measure_launches(launches, trial, tokenizer, eng.request_body(trial), eng.exact_length_key,
                                          rounds, echo, ready_timeout_s=eng.ready_timeout_s)
    except (EngineError, OSError) as e:
        return f"the deploy command could not be verified: {e}", {"deploy_verified": 0.0}
    parts, metrics = [], {"deploy_verified": 1.0}
    for metric, higher, label in VERIFY_METRICS:
        r = paired_ratio(default.series(metric), tuned.series(metric), higher_is_better=higher)
        if r is None:
            why = describe_rounds(default, metric) or describe_rounds(tuned, metric) or "no ratio"
            parts.append(f"{label}: no paired ratio ({why})")
            continue
        metrics.update({f"deploy_{metric}_ratio": r.value, f"deploy_{metric}_ratio_ci_lo": r.lo,
                        f"deploy_{metric}_ratio_ci_hi": r.hi})
        parts.append(f"{label} x{r.value:.2f} [{r.lo:.2f}, {r.hi:.2f}]")
    pooled = {}
    for res, name in ((tuned, "deploy"), (default, "default")):
        metrics[f"{name}_goodput_p50"] = sorted(res.series("goodput"))[len(res.rounds) // 2]
        metrics[f"{name}_incomplete_requests"] = float(sum(r.get("incomplete_requests", 0) for r in res.rounds))
        # every round's requests that met the SLO over every round's time: one figure per launch, descriptive
        met = sum(r["goodput"] * r["duration_s"] for r in res.rounds)
        pooled[name] = metrics[f"{name}_goodput_pooled"] = met / sum(r["duration_s"] for r in res.rounds)
    sent = int(sum(r["request_s"] * r["duration_s"] for r in default.rounds) + 0.5)
    pooled_ratio = f" (x{pooled['deploy'] / pooled['default']:.2f})" if pooled["default"] > 0 else ""
    note = (f"verified by launching the printed command beside the defaults (`{default.command}`), {rounds} interleaved "
            f"rounds: " + "; ".join(parts)
            + f"; goodput over all rounds {pooled['deploy']:.3g} vs {pooled['default']:.3g} req/s{pooled_ratio}; "
            f"requests ended before their length: {metrics['deploy_incomplete_requests']:.0f} vs "
            f"{metrics['default_incomplete_requests']:.0f} of {sent}"
            + "".join(f"; {r.label}: {r.port_note}" for r in (tuned, default) if r.port_note))
    return note, metrics

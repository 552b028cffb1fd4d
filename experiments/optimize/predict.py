"""Cost-model skips for the search: a configuration the roofline (engine/measure/costmodel.py) predicts to
lose is not spent as a trial.

"Lose" is judged only where the prediction can be trusted to rank, and only where the configuration is
predicted dominated on **every** objective: against another configuration of the space with the same numerics
(model, dtype, quantization: the same answers, so accuracy cannot differ) whose predicted time per generated
token is shorter by more than `margin`, and -- when memory is an objective -- whose predicted footprint is no
larger (no more weight bytes, and no KV cache where this one has none: a configuration without a cache is
slower but may win on memory, a point of the front). That catches what the roofline is sure of (no KV cache recomputing the sequence, an attention kernel
that writes the score matrix at long context) and leaves what it cannot see (kernel quality: bitsandbytes on a
CPU is slower than its bytes predict) to measurement.
"""
from __future__ import annotations

import itertools
import logging
from typing import Mapping, Optional

from ..config.compose import SweepError
from .measurement import Point, describe, point_key

log = logging.getLogger(__name__)

NUMERICS = ("model", "model.name", "model.dtype", "quant", "quant.level", "engine", "engine.backend", "engine_variant")
FOOTPRINT = NUMERICS  # the axes that change which weights a configuration holds, and in what format


def _precision(trial, eng):
    """The cost model's widths for `trial` as engine.pipeline.roofline builds them: the engine's weight format, the
    modules it keeps unquantized, its K/V element size."""
    from engine import axes
    from engine.config import replace
    from engine.measure.costmodel import Precision

    costed = replace(replace(trial, "quant.level", eng.weight_level(trial)), "quant.skip_modules", eng.skip_modules(trial))
    q, kv_elt = costed.quant, eng.kv_element_bytes(trial)
    return (Precision.of(costed.model.dtype, q.level, "lm_head" in q.skip_modules, q.keep_last_layers, kv_elt)
            if q.level != axes.QUANT.off else Precision.of(costed.model.dtype, kv_elt_bytes=kv_elt))


def weight_bytes(trial) -> Optional[float]:
    """Bytes of `trial`'s matmul weights as its engine stores them (the model's facts, the cost model's widths):
    what any run of it holds at least. None where the model's shape or the format is unknown."""
    from engine import engines
    from engine.config import EngineError
    from engine.model_facts import facts_or_none

    facts = facts_or_none(trial.model)
    if facts is None or facts.shape is None:
        return None
    try:
        return _precision(trial, engines.get(trial.engine.backend)).weight_bytes(facts.shape)
    except (EngineError, KeyError, ValueError):
        return None


def _what(trial) -> str:
    """'smollm2-135m-instruct float32' (with its quantization where it has one)."""
    q = trial.quant.level
    return f"{trial.model.name} {trial.model.dtype}" + (f" {q}" if q != "none" else "")


def _convert(model) -> bool:
    """Convert a shipped model whose packages are installed but which was never prepared (a new machine's first
    `optimize`: its shape is known only once converted, and its first trial would convert it anyway). True where
    it did."""
    from engine.model_facts import prepared_name
    from engine.models import PREPARED_MODELS, prepare_model, prepared_dir, source_installed

    name = prepared_name(model)
    if name not in PREPARED_MODELS or (prepared_dir(name) / "config.json").is_file() or not source_installed(name):
        return False
    log.info("%s: preparing it once to judge optimize.max_memory_gb against its weights", name)
    prepare_model(name, progress=log.info)
    return True


def weights_floor(disp, space: Mapping[str, list[str]], baseline: Point) -> Optional[tuple[float, str]]:
    """(the fewest weight bytes any configuration of `space` holds, which configuration that is): every
    combination of the FOOTPRINT axes, the others at the baseline; combinations validation refuses never run.
    A shipped model not converted yet is prepared first (its shape comes from the conversion). None where a
    configuration's weights are still unknown (the floor could be lower: nothing is refused on it)."""
    keys = [k for k in space if k in FOOTPRINT]
    best: Optional[tuple[float, str]] = None
    for values in itertools.product(*(space[k] for k in keys)):
        p = {**baseline, **dict(zip(keys, values))}
        try:
            trial = disp.spec(p).trial
        except SweepError:
            continue
        b = weight_bytes(trial)
        if b is None and _convert(trial.model):
            b = weight_bytes(trial)
        if b is None:
            return None
        if best is None or b < best[0]:
            whose = "the baseline's" if p == dict(baseline) else f"the smallest configuration's ({describe(p, baseline)})"
            size = f"{b / 1e9:.2f} GB" if b >= 1e7 else f"{b / 1e6:.3g} MB"
            best = (b, f"{whose} weights alone ({size}, {_what(trial)})")
    return best


class WeightBytes:
    """point -> its weight bytes (`weight_bytes` of its trial; None where it is unknown or validation refuses it)."""

    def __init__(self, disp):
        self.disp = disp

    def __call__(self, p: Point) -> Optional[float]:
        try:
            return weight_bytes(self.disp.spec(p).trial)
        except SweepError:
            return None


class CostModelSkip:
    def __init__(self, disp, space: Mapping[str, list[str]], margin: float = 0.25, memory: bool = True):
        self.disp, self.space, self.margin, self.memory = disp, dict(space), margin, memory
        self._pred: dict[tuple, Optional[tuple[float, float]]] = {}
        self._peaks: dict[tuple, object] = {}  # one probe per dtype: a loaded machine is re-probed on every call

    def _node_peaks(self, dtype: str, threads):
        if (dtype, threads) not in self._peaks:
            import torch

            from engine.measure.hardware import node_peaks

            self._peaks[(dtype, threads)] = node_peaks(torch.device("cpu"), dtype, threads)
        return self._peaks[(dtype, threads)]

    def predicted(self, p: Point) -> Optional[tuple[float, float]]:
        """(seconds per generated token, weight bytes) the roofline predicts for `p`; None when it cannot."""
        key = point_key(p)
        if key not in self._pred:
            self._pred[key] = self._predict(p)
        return self._pred[key]

    def _predict(self, p: Point) -> Optional[tuple[float, float]]:
        """The cost model's inputs as engine.pipeline.roofline builds them for a trial (the engine's weight format,
        the modules it keeps unquantized, its K/V element size, whether its attention materializes scores, the
        dtype its matmuls run in), with this node's peaks probed once per dtype and threads."""
        import torch

        from engine import axes, engines
        from engine.config import EngineError
        from engine.measure.costmodel import Workload, predict
        from engine.model_facts import facts_or_none

        try:
            trial = self.disp.spec(p).trial
        except SweepError:
            return None  # validation refuses it: never measured, nothing to predict
        facts = facts_or_none(trial.model)
        if facts is None or facts.shape is None or trial.workload.serving:
            return None
        eng = engines.get(trial.engine.backend)
        device = torch.device("cpu")
        try:
            prec = _precision(trial, eng)
            wl = trial.workload
            work = Workload(wl.batch_size, wl.context_len, wl.max_new_tokens,
                            axes.KV_CACHE.applied({axes.KV_CACHE.key: trial.kv_cache.mode}), eng.materializes_scores(trial))
            peaks = self._node_peaks(eng.compute_dtype(trial, device), trial.engine.threads or None)
            pred = predict(facts.shape, prec, work, peaks)
        except (EngineError, KeyError, ValueError) as e:  # the cost model cannot price it: measure it
            log.info("no cost-model prediction for %s: %s", describe(p), e)
            return None
        return (pred.prefill_s + pred.decode_s) / max(1, wl.batch_size * wl.max_new_tokens), prec.weight_bytes(facts.shape)

    def kv_applied(self, p: Point) -> bool:
        from engine import axes

        return axes.KV_CACHE.applied({axes.resolve_key(k): v for k, v in p.items()})

    def __call__(self, p: Point, done) -> str:
        mine = self.predicted(p)
        if mine is None:
            return ""
        same = {k: v for k, v in p.items() if k in NUMERICS}
        others = [dict(zip(self.space, vs)) for vs in itertools.product(*self.space.values())]
        for q in others:
            if q == p or any(q.get(k) != v for k, v in same.items()):
                continue
            theirs = self.predicted(q)
            if theirs is None or not theirs[0] * (1 + self.margin) < mine[0]:
                continue
            if self.memory and not (theirs[1] <= mine[1] and (not self.kv_applied(q) or self.kv_applied(p))):
                continue  # it may win on memory: not dominated on every objective
            return (f"predicted {mine[0] / theirs[0]:.1f}x slower per token than {describe(q, p)} "
                    f"(same numerics: same accuracy" + (", no larger footprint)" if self.memory else ")"))
        return ""

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
        from engine.config import EngineError, replace
        from engine.measure.costmodel import Precision, Workload, predict
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
            costed = replace(replace(trial, "quant.level", eng.weight_level(trial)), "quant.skip_modules",
                             eng.skip_modules(trial))
            q, kv_elt = costed.quant, eng.kv_element_bytes(trial)
            prec = (Precision.of(costed.model.dtype, q.level, "lm_head" in q.skip_modules, q.keep_last_layers, kv_elt)
                    if q.level != axes.QUANT.off else Precision.of(costed.model.dtype, kv_elt_bytes=kv_elt))
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

"""The space an `optimize` explores: the axes a sweep of the same overrides would fan out over (the chosen
experiment's `hydra.sweeper.params`, then the command line's comma lists), and the fixed overrides around them.

The overrides are read once, here; a point of the space (an axis value each) becomes its trial through
`Space.trial`, which composes each point once (compose.compose_point) and hands back the validated trial -- its
config and hash -- or its problems, each with the config key it is about. Every consumer (the dispatcher, the
checks before the first trial, the cost model) asks the same Space, so no one translates overrides again."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ..config.compose import (Composed, Composer, InvalidTrial, Problem, SweepError, compose_point, conf_dir,
                              config_problems, describe_error, parse_overrides, sweep_axes)
from ..config.spec import TrialSpec
from .measurement import Point, point_key

SWEEPER_PARAMS = "hydra.sweeper.params."


@dataclass
class Space:
    fixed: list[str]  # the overrides every point shares (model=..., eval=tasks, optimize.*)
    axes: dict[str, list[str]]  # axis key -> values, in the order given
    config: dict[str, Any]  # the composed config of the fixed overrides (optimize settings included)
    parsed: tuple = field(default=(), repr=False, compare=False)  # `fixed`, as Hydra parsed it
    _composed: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # point -> Composed
    _trials: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # (point, rounds) -> trial

    def trial(self, point: Point, interleave: int = 0) -> TrialSpec:
        """The validated trial of `point` (its config and hash); `interleave`: rounds of an interleaved group,
        `cluster.interleave` (where and how it runs, not what: the hash is the point's own), checked again without
        composing the point again. Raises InvalidTrial: its `found` are the problems, each with its config key."""
        key = (point_key(point), interleave)
        if key not in self._trials:
            composed = self.composed(point)
            config = composed.config
            if config is not None and interleave:
                config = copy.deepcopy(config)
                config["cluster"]["interleave"] = interleave
            found = list(composed.found) + (config_problems(config) if config is not None else [])
            self._trials[key] = tuple(found) if found else TrialSpec(config=config)
        got = self._trials[key]
        if isinstance(got, tuple):
            raise InvalidTrial(got)
        return got

    def problems(self, point: Point) -> list[Problem]:
        """What stops `point` from running ([] when it can): never spent as a trial."""
        try:
            self.trial(point)
            return []
        except InvalidTrial as e:
            return list(e.found)

    def composed(self, point: Point) -> Composed:
        """`point` composed on the fixed overrides, once per point for the life of the space."""
        key = point_key(point)
        if key not in self._composed:
            self._composed[key] = compose_point(list(self.parsed), point)
        return self._composed[key]


def _key(o) -> str:
    return o.get_key_element()


def _optimize_setting(key: str) -> bool:
    return key.split(".")[0] == "optimize" or key == "experiment"


def read_space(overrides: list[str]) -> Space:
    """Split `overrides` into the fixed part and the axes (compose.sweep_axes: the sweep's own reading, each
    value composed alone); every problem is the user's (SweepError), reported at once."""
    # a new SLO metric is a key the user adds to an open mapping: Hydra wants `++` for that
    overrides = [("++" + o) if o.startswith("optimize.slo.") else o for o in overrides]
    parsed = parse_overrides(overrides)
    fixed = [o for o in parsed if not o.is_sweep_override()]
    sweeps = [o for o in parsed if o.is_sweep_override()]
    problems = [f"{_key(o)}: optimize settings take one value, not a list" for o in sweeps if _optimize_setting(_key(o))]
    sweeps = [o for o in sweeps if not _optimize_setting(_key(o))]
    # Hydra's own spelling of an axis (hydra.sweeper.params.quant=a,b) is that axis: the same as quant=a,b
    sweeps = [parse_overrides([f"{_key(o)[len(SWEEPER_PARAMS):]}={o.input_line.split('=', 1)[1]}"])[0]
              if _key(o).startswith(SWEEPER_PARAMS) else o for o in sweeps]
    # `attention=[sdpa]` would select a list of group options (Hydra merges them): neither a pinned value nor an
    # axis. Refused like `attention=choice(sdpa)`, with both spellings of what was meant.
    for o in fixed:
        key = _key(o).lstrip("+~")
        if isinstance(o.value(), list) and key and (conf_dir() / key).is_dir():
            vals = [str(v) for v in o.value()]
            problems.append(f"{key}: a list ([{', '.join(vals)}]) is no axis; write {key}={','.join(vals) or 'a,b'} for "
                            f"an axis of several values" + (f", or pin it as {key}={vals[0]}" if vals else ""))
    fixed_strs = [o.input_line for o in fixed]
    with Composer() as c:
        problems += [msg for o in fixed if (msg := c.missing_option(_key(o), o.value())) is not None]
        if problems:
            raise SweepError(problems)
        try:
            config, params = c.compose(fixed_strs, optimize=True)
        except Exception as e:
            raise SweepError([describe_error("overrides", e)]) from None
        axes = sweep_axes(c, fixed, fixed_strs, params, sweeps, problems)
    if problems:
        raise SweepError(problems)
    return Space(fixed_strs, axes, config, tuple(fixed))


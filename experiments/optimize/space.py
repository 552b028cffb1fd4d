"""The space an `optimize` explores: the axes a sweep of the same overrides would fan out over (the chosen
experiment's `hydra.sweeper.params`, then the command line's comma lists), and the fixed overrides around them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.compose import (Composer, SweepError, _first_lines, _key, _parse, conf_dir, describe_error,
                              sweep_axes)

SWEEPER_PARAMS = "hydra.sweeper.params."


@dataclass
class Space:
    fixed: list[str]  # the overrides every point shares (model=..., eval=tasks, optimize.*)
    axes: dict[str, list[str]]  # axis key -> values, in the order given
    config: dict[str, Any]  # the composed config of the fixed overrides (optimize settings included)


def read_space(overrides: list[str]) -> Space:
    """Split `overrides` into the fixed part and the axes (compose.sweep_axes: the sweep's own reading, each
    value composed alone); every problem is the user's (SweepError), reported at once."""
    # a new SLO metric is a key the user adds to an open mapping: Hydra wants `++` for that
    overrides = [("++" + o) if o.startswith("optimize.slo.") else o for o in overrides]
    try:
        parsed = _parse(overrides)
    except Exception as e:
        raise SweepError([f"override syntax: {_first_lines(e)}"]) from None
    fixed = [o for o in parsed if not o.is_sweep_override()]
    sweeps = [o for o in parsed if o.is_sweep_override()]
    problems = [f"{_key(o)}: optimize settings take one value, not a list" for o in sweeps
                if _key(o).split(".")[0] == "optimize" or _key(o) == "experiment"]
    sweeps = [o for o in sweeps if _key(o).split(".")[0] != "optimize" and _key(o) != "experiment"]
    # Hydra's own spelling of an axis (hydra.sweeper.params.quant=a,b) is that axis: the same as quant=a,b
    sweeps = [_parse([f"{_key(o)[len(SWEEPER_PARAMS):]}={o.input_line.split('=', 1)[1]}"])[0]
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
        for o in fixed:
            if (msg := c.missing_option(_key(o), o.value())) is not None:
                problems.append(msg)
        if problems:
            raise SweepError(problems)
        try:
            config, params = c.compose(fixed_strs, optimize=True)
        except Exception as e:
            raise SweepError([describe_error("overrides", e)]) from None
        axes = sweep_axes(c, fixed, fixed_strs, params, sweeps, problems)
    if problems:
        raise SweepError(problems)
    return Space(fixed_strs, axes, config)

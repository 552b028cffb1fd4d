"""Hydra compose + sweep expansion + validation: overrides in, a validated list of TrialSpecs out.

Every problem is collected before anything runs: override syntax, unknown groups/options/keys and wrong
types (each override is composed alone so one bad value does not hide the next), then value checks of
every expanded trial. A `SweepError` carries them all.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import os
import pickle
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

from omegaconf import OmegaConf, open_dict

from engine.config import EngineError
from engine.tasks.user import absolute as absolute_task_files

from . import schema
from ..errors import UserError
from .spec import TrialSpec, build_trial, fold_aliases, normalize

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def conf_dir() -> Path:
    return Path(os.environ.get("INFERSWEEP_CONF") or PROJECT_ROOT / "conf")


class SweepError(UserError):
    """Every problem found in a sweep, reported together."""

    heading = "invalid sweep"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem with a trial, kept structured so a reader can ask what it is about without parsing text: the
    canonical config key it concerns (`kv_cache.mode`; '' where it names several keys or none, like a bundle
    conflict or a config the engine's dataclasses refuse) and why. `label`: the spelling shown before the reason
    where it is not the key itself (`model.dtype=auto`, `overrides`)."""

    key: str
    why: str
    label: str = ""

    def __str__(self) -> str:
        head = self.label or self.key
        return f"{head}: {self.why}" if head else self.why


class InvalidTrial(SweepError):
    """One trial's problems: `found` structured (Problem), `problems` as the user reads them."""

    def __init__(self, found: Iterable[Problem]):
        self.found = tuple(found)
        super().__init__([str(p) for p in self.found])


def _first_lines(e: Exception, n: int = 2) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return " | ".join(lines[:n])


def _schema_keys(node) -> set[str]:
    out: set[str] = set()
    for k, v in node.items():
        out.add(k)
        if isinstance(v, dict):
            out |= {f"{k}.{sub}" for sub in _schema_keys(v)}
    return out


def _schema_tree() -> dict:
    return copy.deepcopy(_schema_tree_cached())


@functools.lru_cache(maxsize=1)
def _schema_tree_cached() -> dict:
    return OmegaConf.to_container(OmegaConf.structured(schema.TrialConf), resolve=False, throw_on_missing=False)


@functools.lru_cache(maxsize=1)
def _schema_key_set() -> frozenset:
    return frozenset(_schema_keys(_schema_tree_cached()))


def unknown_option(group: str, options: Iterable[str]) -> str:
    return str(_unknown_option(group, options))


def _unknown_option(group: str, options: Iterable[str]) -> Problem:
    return Problem(group, f"unknown option; available: {', '.join(options)}")


def describe_error(key: str, e: Exception) -> str:
    """Hydra's error for one override, rewritten to name the key and what is allowed."""
    return str(_described(key, e))


def _described(key: str, e: Exception) -> Problem:
    """`describe_error`, structured: the key the error is about (an option's group, an unknown key) and why."""
    msg = str(e)
    if "Could not find" in msg and "Available options" in msg:
        options = []
        for ln in msg.split("Available options", 1)[1].splitlines()[1:]:
            if not ln.startswith("\t"):
                break
            options.append(ln.strip())
        return _unknown_option(key.split("@")[0].lstrip("+~"), options)
    if "Could not override" in msg or "Could not append" in msg:
        parent = key.lstrip("+~").rsplit(".", 1)[0] if "." in key else ""
        tree = _schema_tree()
        node = tree
        for part in parent.split(".") if parent else []:
            node = node.get(part, {}) if isinstance(node, dict) else {}
        known = sorted(k for k in node) if isinstance(node, dict) else []
        where = f"in {parent}" if parent else "at top level"
        return Problem(key.lstrip("+~"), f"unknown key; keys {where}: {', '.join(known)}")
    cause = e.__cause__ or e.__context__
    if cause is not None and "Error merging override" in msg:
        return Problem(key, _first_lines(cause, 1))
    return Problem(key, _first_lines(e))


def _unknown(config: dict) -> list[str]:
    extra = {k for k in _schema_keys(config) - _schema_key_set()
             if not any(k.startswith(m + ".") for m in schema.OPEN_MAPPINGS)}
    return sorted(k for k in extra if not any(k.startswith(p + ".") for p in extra))


def _prune(config: dict, dotted: list[str]) -> dict:
    out = copy.deepcopy(config)
    for key in dotted:
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node[p]
        node.pop(leaf, None)
    return out


def check_config(config: dict, gpu_available: bool | None = None) -> list[str]:
    """All problems of one resolved config: keys the schema does not know (added with `+key=`), then
    value checks of the rest."""
    return [str(p) for p in config_problems(config, gpu_available)]


def config_problems(config: dict, gpu_available: bool | None = None) -> list[Problem]:
    """`check_config`, structured: each problem with the config key it is about."""
    extra = _unknown(config)
    return [Problem(k, "unknown key (not in the trial schema)") for k in extra] + _validated(
        _prune(config, extra), gpu_available)


_COMPOSITIONS: dict[tuple, "Composition"] = {}  # see Composer.composition
# Hydra's words for a group choice spelled for the wrong defaults list (see Composer.compose_raw)
_NOT_IN_DEFAULTS = re.compile(r"Could not override '([\w/.-]+)'\. No match in the defaults list")
_CHOSEN_TWICE = re.compile(r"Multiple values for ([\w/.-]+)\. To override a value use")
_COMPOSITIONS_MAX = 256


def _tree_state(root: Path) -> tuple:
    """What a composition depends on besides its overrides: the config tree as (path, size, mtime) of
    every file; an edited, added or removed file changes it."""
    out = [str(root)]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            st = os.stat(os.path.join(dirpath, name))
            out.append((os.path.join(dirpath, name), st.st_size, st.st_mtime_ns))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Composition:
    """One Hydra composition (without its `hydra` node), never changed in place, the experiment's sweeper
    params, and the composition pickled: `copy()` unpickles it, 3x faster than `copy.deepcopy` of OmegaConf
    nodes (a pickle costs ~1 ms, a compose 150-300 ms)."""

    cfg: Any
    params: dict[str, str]
    blob: bytes
    choices: dict[str, Any] = dataclasses.field(default_factory=dict)  # group -> option (Hydra's runtime.choices)

    def copy(self):
        return pickle.loads(self.blob)


class Composer:
    """Holds one Hydra context; `compose(overrides)` returns the resolved config as plain containers."""

    def __init__(self, config_name: str = "config"):
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        schema.register()
        if GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()
        self._ctx = initialize_config_dir(config_dir=str(conf_dir()), version_base=None, job_name="infersweep")
        self._ctx.__enter__()
        self.config_name = config_name
        self.conf_state = _tree_state(conf_dir())

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def missing_option(self, key: str, value: Any, label: str | None = None) -> str | None:
        """The problem when `key=value` chooses a config group option that does not exist, else None.
        Hydra reports that itself, except for groups the defaults list marks `optional` (experiment):
        there it silently composes without them, and a typo would run the default trial instead."""
        found = self.missing(key, value, label)
        return None if found is None else str(found)

    def missing(self, key: str, value: Any, label: str | None = None) -> Problem | None:
        """`missing_option`, structured (about the group)."""
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.object_type import ObjectType

        group = key.lstrip("+").split("@")[0]
        if key.startswith("~") or not isinstance(value, str) or value == "null":
            return None
        # hydra.compose has no way to list a group's options; GlobalHydra's config loader (hydra.core, the
        # interface hydra's own plugins use) does, through its public ConfigLoader methods
        loader = GlobalHydra.instance().config_loader()
        if not _group_exists(loader, group):
            return None
        options = loader.get_group_options(group, ObjectType.CONFIG)
        return None if value in options else _unknown_option(label or group, options)

    def compose_raw(self, overrides: list[str]):
        """Hydra's compose, with a group choice spelled the way the defaults list needs it: `group=option`
        for a group the defaults list lacks (engine_variant, outside `experiment=engines`) appends it, as
        `+group=option` does; `+group=option` for a group it has (inside that experiment) overrides it."""
        from hydra import compose
        from hydra.errors import ConfigCompositionException

        tried = [list(overrides)]
        while True:
            try:
                return compose(self.config_name, overrides=tried[-1], return_hydra_config=True)
            except ConfigCompositionException as e:
                respelled = self._respell_group_choice(tried[-1], str(e))
                if respelled is None or respelled in tried:
                    raise
                tried.append(respelled)

    def _respell_group_choice(self, overrides: list[str], error: str) -> list[str] | None:
        from hydra.core.global_hydra import GlobalHydra

        if m := _NOT_IN_DEFAULTS.search(error):
            group, old, new = m.group(1), "", "+"
        elif m := _CHOSEN_TWICE.search(error):
            group, old, new = m.group(1), "+", ""
        else:
            return None
        if not _group_exists(GlobalHydra.instance().config_loader(), group):
            return None
        for i, line in enumerate(overrides):
            if line.startswith(f"{old}{group}="):
                return overrides[:i] + [new + line[len(old):]] + overrides[i + 1:]
        return None

    def composition(self, overrides: list[str]) -> Composition:
        """Hydra's full compose of `overrides` without its `hydra` node, and the experiment's sweeper params.
        Cached per override list and state of the config tree (every file's path, size and mtime), across
        Composers: an axis value checked alone and the trials that use it compose once, and so does
        the same sweep expanded twice in one process. Value overrides are applied to a `copy()`."""
        key = (self.conf_state, self.config_name, tuple(overrides))
        if key not in _COMPOSITIONS:
            cfg = self.compose_raw(list(overrides))
            raw = cfg.hydra.sweeper.get("params")
            params = OmegaConf.to_container(raw, resolve=False) if raw is not None else {}
            choices = OmegaConf.to_container(cfg.hydra.runtime.choices, resolve=False)
            with open_dict(cfg):
                del cfg["hydra"]  # its own interpolations only resolve inside a Hydra job
            while len(_COMPOSITIONS) >= _COMPOSITIONS_MAX:
                _COMPOSITIONS.pop(next(iter(_COMPOSITIONS)))
            _COMPOSITIONS[key] = Composition(cfg, {str(k): str(v) for k, v in params.items()}, pickle.dumps(cfg),
                                             {str(k): v for k, v in choices.items()})
        return _COMPOSITIONS[key]

    def choices(self, fixed: list[str], extra: list[str]) -> dict[str, Any]:
        """Hydra's group choices (group -> option) of `compose_fast(fixed, extra)`'s composition."""
        return dict(self.composition(fixed + [o for o in extra if not _is_value_override(o)]).choices)

    def compose(self, overrides: list[str], optimize: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
        """(resolved trial config without `hydra`, the experiment's sweeper params). `optimize`: keep the
        `optimize` section (infersweep optimize's settings, not part of a trial)."""
        c = self.composition(overrides)
        data = OmegaConf.to_container(c.cfg, resolve=True)
        if not optimize:
            data.pop("optimize", None)
        return data, dict(c.params)

    def compose_fast(self, fixed: list[str], extra: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
        """`compose(fixed + extra)`, with Hydra's full compose run once per distinct set of *group*
        choices: plain key overrides in `extra` (seed=3, workload.context_len=512) are applied to a copy of
        that cached composition with Hydra's own override logic, as Hydra applies them after composing.
        A 1,000-value axis thus costs one compose, not 1,000 (~0.15 s each). Any failure falls back to
        the full compose, so errors read exactly as before."""
        groups = [o for o in extra if not _is_value_override(o)]
        values = [o for o in extra if _is_value_override(o)]
        if not values:
            return self.compose(fixed + extra)
        # the same call twice (an axis value checked alone, then the trial of a one-axis sweep) is one compose
        done = self.__dict__.setdefault("_fast_results", {})
        key = (tuple(fixed), tuple(extra))
        if key in done:
            data, params = done[key]
            return copy.deepcopy(data), dict(params)
        try:
            base = self.composition(fixed + groups)
            cfg = base.copy()
            _apply_value_overrides(_parse(values), cfg)
            data = OmegaConf.to_container(cfg, resolve=True)
            data.pop("optimize", None)  # optimize's settings, not the trial's (as `compose`)
        except Exception:
            return self.compose(fixed + extra)
        done[key] = (data, base.params)
        return copy.deepcopy(data), dict(base.params)


def _group_exists(loader, group: str) -> bool:
    """Whether `group` (`a/b` when nested) is a config group, through the config loader's public interface."""
    parent, _, name = group.rpartition("/")
    return name in loader.list_groups(parent)


def _apply_value_overrides(overrides, cfg) -> None:
    """Hydra's rules for value overrides applied to a composed `cfg`: `key=value` changes a key the config has,
    `+key=value` adds one it lacks, `++key=value` adds or changes. Hydra has no public call for this step (its
    own is the private `ConfigLoaderImpl._apply_overrides_to_config`), so its rules are written out here on
    OmegaConf's public `update`; a deletion (`~key`) or a package raises, and `compose_fast` leaves that
    override to Hydra's full compose."""
    for o in overrides:
        if o.package is not None or o.is_delete():
            raise ValueError(f"{o.input_line}: left to Hydra's full compose")
        key, value = o.key_or_group, o.value()
        if o.is_add():
            if OmegaConf.select(cfg, key, throw_on_missing=False) is not None and not isinstance(value, (dict, list)):
                raise ValueError(f"{o.input_line}: {key} is already in the config")
            OmegaConf.update(cfg, key, value, merge=True, force_add=True)
        else:
            OmegaConf.update(cfg, key, value, merge=True, force_add=o.is_force_add())


def _is_value_override(line: str) -> bool:
    """`key=value` that sets a value (not a config group choice, not hydra's own, no package)."""
    key = line.split("=", 1)[0].lstrip("+~")
    if not key or "@" in key or "/" in key or key.split(".")[0] == "hydra":
        return False
    return not (conf_dir() / key).is_dir()


def _parse(overrides: Iterable[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(list(overrides))


def _values(override) -> list[str]:
    if override.is_sweep_override():
        return list(override.sweep_string_iterator())
    return [override.get_value_element_as_str()]


def _unescape(value: str) -> str:
    """An axis value as the user means it (`tiny://llama`), not in Hydra's override syntax (`tiny\\://llama`),
    which is what composing needs but not what tables, run names and labels should show."""
    return re.sub(r"\\(.)", r"\1", value)


def _key(override) -> str:
    return override.get_key_element()


# --- groups whose options set several axes at once -------------------------------------------------------
# An engine variant (conf/engine_variant/) is one engine at one number format: it sets engine.backend,
# attention.impl, quant.level, model.dtype (and kv_cache.mode) together. Choosing one of those on the command
# line too (`engine=hf`, `quant=none`, `model.dtype=...`) would be silently lost to the variant or silently
# win over it, so a different value is an error naming both keys; the same value is harmless. A server
# (conf/server/) is likewise one engine with the batching it can schedule (experiment=serving-capacity).
BUNDLE_GROUPS = ("engine_variant", "server")
BUNDLE_WHAT = {"engine_variant": "an engine variant sets the engine, attention, quant and dtype itself",
               "server": "a server sets the engine, its batching and its KV cache itself"}


def _flat(node: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


@functools.lru_cache(maxsize=None)
def _option_values(root: str, group: str, option: str) -> dict[str, str]:
    """{dotted key: value} that `conf/<group>/<option>.yaml` sets (in its package: the group, or `_global_`)."""
    import yaml

    path = Path(root) / group / f"{option}.yaml"
    if not path.is_file():
        return {}
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        return {}
    data.pop("defaults", None)
    glob = any(ln.strip().replace(" ", "") == "#@package_global_" for ln in text.splitlines()[:5])
    return {k: str(v) for k, v in _flat(data, "" if glob else group.replace("/", ".")).items()}


def _axis_values(key: str, value: Any) -> dict[str, str]:
    """The axis keys a command-line choice sets: `quant=none` -> {quant.level: none} (an axis group's
    option sets its axis key), `model.dtype=float16` -> itself; other groups (model, workload) none."""
    from engine.axes import resolve_key

    if (conf_dir() / key).is_dir():
        axis_key = resolve_key(key)
        if axis_key == key or not isinstance(value, str):
            return {}
        sets = _option_values(str(conf_dir()), key, value)
        return {axis_key: sets[axis_key]} if axis_key in sets else {}
    return {k: str(v) for k, v in _flat(value, key).items()}


def bundle_conflicts(choices: dict[str, Any], requested: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(`key=value` as requested, `group=option` of the bundle, `axis_key=value` the bundle sets instead) for
    every requested choice that a chosen bundle option (`choices`: Hydra's group -> option) contradicts."""
    out = []
    for group in BUNDLE_GROUPS:
        option = choices.get(group)
        if not isinstance(option, str):
            continue
        sets = _option_values(str(conf_dir()), group, option)
        for key, value in requested.items():
            for axis_key, want in _axis_values(key, value).items():
                got = sets.get(axis_key)
                if got is not None and got != want:
                    out.append((f"{key}={_unescape(str(value)) if isinstance(value, str) else value}",
                                f"{group}={option}", f"{axis_key}={got}"))
    return out


def _bundle_problems(conflicts: dict[str, dict[str, str]]) -> list[str]:
    """One message per requested choice, naming every bundle option that contradicts it."""
    out = []
    for req, by_option in conflicts.items():
        what = BUNDLE_WHAT[next(iter(by_option)).split("=")[0]]
        if len(by_option) == 1:
            ((option, sets),) = by_option.items()
            out.append(f"{req} conflicts with {option}, which sets {sets}: {what}; drop one of the two")
        else:
            them = ", ".join(f"{o} (sets {s})" for o, s in by_option.items())
            out.append(f"{req} conflicts with {them}: {what}; drop {req} or those "
                       f"{'variants' if what.startswith('an engine variant') else 'options'}")
    return out


def expand(overrides: list[str], gpu_available: bool | None = None) -> list[TrialSpec]:
    """Expand CLI overrides (+ the chosen experiment's `hydra.sweeper.params`) into validated trials. Each step
    adds what it finds to one list of problems and drops what it found bad, so the later steps still run and
    the `SweepError` reports everything at once."""
    problems: list[str] = []
    fixed, sweeps = _split_overrides(overrides, problems)
    with Composer() as c:
        fixed = _known_options(c, fixed, problems)
        fixed, params = _compose_fixed(c, fixed, problems)
        fixed_strs = [o.input_line for o in fixed]
        axes = sweep_axes(c, fixed, fixed_strs, params, sweeps, problems)
        specs, conflicts = _trials(c, fixed, fixed_strs, axes, gpu_available, problems)
    problems += _bundle_problems(conflicts)
    problems += _trial_problems(specs, gpu_available)
    if problems:
        raise SweepError(_dedupe(problems))
    return specs


def parse_overrides(overrides: Iterable[str]) -> list:
    """Hydra's parse of command-line overrides (its `Override` objects); bad syntax is a SweepError."""
    try:
        return _parse(overrides)
    except Exception as e:  # hydra's OverrideParseException
        raise SweepError([f"override syntax: {_first_lines(e)}"]) from None


def _split_overrides(overrides: list[str], problems: list[str]) -> tuple[list, list]:
    """(fixed overrides, sweep overrides `key=a,b`), parsed; a syntax error ends the expansion at once."""
    parsed = parse_overrides(overrides)
    fixed = [o for o in parsed if not o.is_sweep_override()]
    sweeps = [o for o in parsed if o.is_sweep_override()]
    for o in sweeps:
        if _key(o).split("@")[0] == "experiment":
            problems.append("experiment: sweep one experiment at a time (got a list)")
    return fixed, sweeps


def _known_options(c: "Composer", fixed: list, problems: list[str]) -> list:
    """The fixed overrides without those that choose a group option that does not exist."""
    out = []
    for o in fixed:
        if (msg := c.missing_option(_key(o), o.value())) is not None:
            problems.append(msg)
        else:
            out.append(o)
    return out


def _compose_fixed(c: "Composer", fixed: list, problems: list[str]) -> tuple[list, dict[str, str]]:
    """(the fixed overrides that compose, the experiment's sweeper params). When they fail together, each is
    composed alone so every bad key/option/type is reported, not just the first, and the bad ones are dropped;
    when only their combination fails, the expansion ends here."""
    try:
        return fixed, c.compose([o.input_line for o in fixed])[1]
    except Exception:
        good = []
        for o in fixed:
            try:
                c.compose([o.input_line])
                good.append(o)
            except Exception as e:
                problems.append(describe_error(_key(o), e))
        try:
            return good, c.compose([o.input_line for o in good])[1]
        except Exception as e:  # only the combination fails
            problems.append(describe_error("overrides", e))
            raise SweepError(problems) from None


def sweep_axes(c: "Composer", fixed: list, fixed_strs: list[str], params: dict[str, str], sweeps: list,
               problems: list[str]) -> dict[str, list[str]]:
    """key -> values of every sweep axis: the experiment's params, then the command line's (which win per key);
    a key pinned on the command line is no axis. Each value is composed alone, and a bad one dropped. The one
    reading of the axes: `expand` and `infersweep optimize` (experiments/optimize/space.py) both call it."""
    fixed_keys = {_key(o).lstrip("+") for o in fixed}
    axes: dict[str, list[str]] = {}
    for k, v in params.items():
        if k in fixed_keys:
            continue  # pinned on the command line
        try:
            (o,) = _parse([f"{k}={v}"])
            axes[_key(o)] = _values(o)
        except Exception as e:
            problems.append(f"experiment sweeper param {k}: {_first_lines(e)}")
    for o in sweeps:
        axes[_key(o)] = _values(o)
    for k in list(axes):
        if not axes[k]:
            problems.append(f"{k}: empty sweep list")
        good_vals = []
        for v in axes[k]:
            if (msg := c.missing_option(k, _unescape(v), label=f"{k}={v}")) is not None:
                problems.append(msg)
                continue
            try:
                c.compose_fast(fixed_strs, [f"{k}={v}"])
                good_vals.append(v)
            except Exception as e:
                problems.append(describe_error(f"{k}={v}", e))
        axes[k] = good_vals or axes[k][:0]
        if not axes[k]:
            del axes[k]
    return axes


def _trials(c: "Composer", fixed: list, fixed_strs: list[str], axes: dict[str, list[str]],
            gpu_available: bool | None, problems: list[str]) -> tuple[list[TrialSpec], dict[str, dict[str, str]]]:
    """(the Cartesian product of the axes, each trial composed, normalized and hashed, a combination that only
    differed in what cannot change it run once; the bundle conflicts: requested choice -> {option: what it sets})."""
    keys = list(axes)
    chosen = _chosen(fixed)
    conflicts: dict[str, dict[str, str]] = {}
    specs: list[TrialSpec] = []
    hashes: set[str] = set()
    merged_hashes: set[str] = set()  # hashes a normalization produced: a repeat is the same trial
    for i, combo in enumerate(itertools.product(*(axes[k] for k in keys))):
        swept = dict(zip(keys, combo))
        one = _compose_one(c, fixed_strs, chosen, swept, len(specs), gpu_available)
        for req, option, sets in one.conflicts:
            conflicts.setdefault(req, {})[option] = sets
        if one.problem is not None:
            problems.append(str(one.problem) if one.composed else f"trial {i} ({swept}): {one.problem}")
            continue
        spec = one.spec
        if spec.config_hash in hashes and (one.merged or spec.config_hash in merged_hashes):
            continue
        if one.merged:
            merged_hashes.add(spec.config_hash)
        hashes.add(spec.config_hash)
        specs.append(spec)
    return specs, conflicts


def _chosen(fixed: list) -> dict[str, Any]:
    """What the command line chose itself, for the bundle check (an engine variant must not contradict it)."""
    return {o.key_or_group: o.value() for o in fixed
            if not o.is_delete() and o.key_or_group not in BUNDLE_GROUPS + ("experiment",)}


class _One(NamedTuple):
    """One combination of axis values on the fixed overrides (`_compose_one`)."""

    spec: TrialSpec | None  # composed, normalized, hashed; None when a problem stopped it
    merged: bool = False  # a normalization made it: a repeat of its hash is the same trial
    conflicts: tuple | list = ()  # its bundle conflicts (`bundle_conflicts`)
    problem: Problem | None = None
    composed: bool = False  # Hydra composed it (a problem came after)


def _compose_one(c: "Composer", fixed_strs: list[str], chosen: dict[str, Any], swept: dict[str, str], index: int,
                 gpu_available: bool | None) -> _One:
    extra = [f"{k}={v}" for k, v in swept.items()]
    try:
        config, _ = c.compose_fast(fixed_strs, extra)
    except Exception as e:
        p = _described("overrides", e)
        return _One(None, problem=Problem("", p.why, "overrides") if p.key == "overrides" else p)
    requested = dict(chosen, **{k: v for k, v in swept.items() if k not in BUNDLE_GROUPS})
    conflicts = bundle_conflicts(c.choices(fixed_strs, extra), requested)
    # keys that cannot change this trial (speculative.k with speculative=off) are reset, and a
    # combination that only differed in them is the same trial: run it once
    config, inert = normalize(config)
    config = absolute_task_files(config)  # eval.task_files read the same wherever the trial runs
    # a value the engine runs as another (llama.cpp attention=sdpa is eager) is that value
    config, folded = fold_aliases(config)
    kept = {k: folded.get(k, _unescape(v)) for k, v in swept.items() if k not in inert}
    # model.dtype=auto becomes this hardware's dtype before hashing (the hash names what ran); a
    # sweep of auto,float32 on a CPU without bf16 units is then one trial, not a duplicate
    try:
        config, resolved = resolve_auto_dtype(config, gpu_available)
    except EngineError as e:  # e.g. a bad INFERSWEEP_CPU_BF16: a clear problem, not a traceback
        return _One(None, conflicts=conflicts, problem=Problem("model.dtype", str(e), "model.dtype=auto"), composed=True)
    if resolved and "model.dtype" in kept:
        kept["model.dtype"] = config["model"]["dtype"]
    merged = len(kept) < len(swept) or resolved or bool(folded)
    return _One(TrialSpec(config=config, swept=kept, index=index), merged, conflicts)


@dataclasses.dataclass(frozen=True)
class Composed:
    """One point composed on fixed overrides: its resolved config, normalized as a sweep's trial (None when it did
    not compose), and the problems found composing it (an unknown option, a bundle conflict); the config's own
    value checks are `config_problems`'."""

    config: dict[str, Any] | None
    found: tuple[Problem, ...] = ()


def compose_point(fixed: list, point: Mapping[str, str], gpu_available: bool | None = None) -> Composed:
    """`point` ({key: value}, each value in override syntax as an axis holds it) on the parsed `fixed` overrides
    (`parse_overrides`), composed once as `expand` composes a trial of a sweep over those keys. The trial it makes
    is the fixed overrides' own: a run records no swept keys for it."""
    fixed_strs = [o.input_line for o in fixed]
    with Composer() as c:
        found = [p for k, v in point.items() if (p := c.missing(k, _unescape(v))) is not None]
        if found:
            return Composed(None, tuple(found))
        one = _compose_one(c, fixed_strs, _chosen(fixed), dict(point), 0, gpu_available)
    by_request: dict[str, dict[str, str]] = {}
    for req, option, sets in one.conflicts:
        by_request.setdefault(req, {})[option] = sets
    # a bundle conflict names two keys at once: about no one key
    found = ([one.problem] if one.problem else []) + [Problem("", msg) for msg in _bundle_problems(by_request)]
    return Composed(one.spec.config if one.spec is not None else None, tuple(found))


def _trial_problems(specs: list[TrialSpec], gpu_available: bool | None) -> list[str]:
    """Value checks of every trial (a message shared by some trials names them) and trials that are the same
    configuration."""
    problems: list[str] = []
    by_msg: dict[str, list[str]] = {}
    seen: dict[str, int] = {}
    for spec in specs:
        for msg in check_config(spec.config, gpu_available):
            by_msg.setdefault(msg, []).append(spec.label)
        h = spec.config_hash
        if h in seen:
            problems.append(f"trials {seen[h]} and {spec.index} are the same configuration (hash {h[:12]})")
        seen[h] = spec.index
    for msg, labels in by_msg.items():
        if len(labels) == len(specs) or len(specs) == 1:
            problems.append(msg)
        else:
            shown = "; ".join(labels[:3]) + (f"; and {len(labels) - 3} more" if len(labels) > 3 else "")
            problems.append(f"{msg}  [in {len(labels)} of {len(specs)} trials: {shown}]")
    return problems


def resolve_auto_dtype(config: dict[str, Any], gpu_available: bool | None = None) -> tuple[dict[str, Any], bool]:
    """(config with `model.dtype: auto` replaced by the dtype this hardware runs fastest, whether it was).
    CPU: bfloat16 where the CPU has bf16 units, else float32 (engine.measure.hardware detects it; bitsandbytes on
    CPU needs float32). GPU trials: what the local GPU supports, or bfloat16 when the driver has none."""
    from engine.measure.hardware import preferred_cpu_dtype, preferred_dtype

    model = config.get("model") or {}
    if model.get("dtype") != "auto":
        return config, False
    from cluster import ClusterConfig

    gpu = ClusterConfig.from_dict(config["cluster"]).num_gpus_per_trial > 0 if gpu_available is None else gpu_available
    if gpu:
        import torch

        dtype = preferred_dtype("cuda") if torch.cuda.is_available() else "bfloat16"
    elif str((config.get("quant") or {}).get("level", "none")).startswith("bnb-"):
        dtype = "float32"
    else:
        dtype = preferred_cpu_dtype()
    out = copy.deepcopy(config)
    out["model"]["dtype"] = dtype
    return out, True


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def validate(config: dict[str, Any], gpu_available: bool | None = None) -> list[str]:
    """Value checks of one resolved trial config; messages name the config key and what is allowed."""
    return [str(p) for p in _validated(config, gpu_available)]


def _validated(config: dict[str, Any], gpu_available: bool | None = None) -> list[Problem]:
    from engine.validation import check_trial

    from cluster import ClusterConfig

    cl = ClusterConfig.from_dict(config["cluster"])
    # the cluster's messages name their key in their text (cluster/config.py): kept whole, not split apart
    out = [Problem("", msg) for msg in cl.problems()] + _tracking_problems(config["tracking"])
    try:
        trial = build_trial(config, cl)
    except (TypeError, ValueError, EngineError) as e:  # the config as a whole: the message names where
        return out + [Problem("", str(e))]
    gpu = cl.num_gpus_per_trial > 0 if gpu_available is None else gpu_available
    out += [Problem(key, msg) for key, msg in check_trial(trial, gpu_available=gpu)]
    if cl.interleave and trial.workload.serving and trial.capacity.search:
        out.append(Problem("cluster.interleave", "a capacity search runs its own probes one after another; it cannot "
                           "be interleaved with other trials (drop cluster.interleave or capacity.search)"))
    if cl.interleave:
        out += _interleave_engine_problems(trial.engine.backend)
    return out


def _interleave_engine_problems(backend: str) -> list[Problem]:
    """Interleaving calls each variant's engine once per round in the worker's process: an engine that runs
    in its own process would be started again for every timed repeat (the registry's `in_process`), unless its
    session keeps that process between runs (`interleaves`: a served engine's server)."""
    from engine import engines

    if backend not in engines.NAMES or engines.get(backend).in_process or engines.get(backend).interleaves:
        return []
    able = [e.name for e in engines.all_engines() if e.in_process or e.interleaves]
    return [Problem("cluster.interleave", f"engine={backend} runs in its own process, and interleaving measures its "
                    f"variants round-robin inside one worker process; drop cluster.interleave (cluster.interleave=0) "
                    f"or use an engine that runs in-process: {', '.join(able)}")]


def _tracking_problems(tr: dict[str, Any]) -> list[Problem]:
    out = []
    if tr.get("serve") and str(tr.get("uri", "")).startswith(("http://", "https://")):
        out.append(Problem("tracking.serve", "true needs a database uri (sqlite:/// or postgresql://) to serve, not a "
                           "server"))
    if tr.get("workers", 1) < 1:
        out.append(Problem("tracking.workers", f"must be >= 1, got {tr['workers']}"))
    return out


def load_trial(config: dict[str, Any]) -> TrialSpec:
    """A TrialSpec from a stored resolved config (reproduce): re-validated through the schema."""
    schema.register()
    base = OmegaConf.structured(schema.TrialConf)
    merged = OmegaConf.merge(base, OmegaConf.create(config))
    data = OmegaConf.to_container(merged, resolve=True)
    data.pop("optimize", None)
    problems = check_config(data)
    if problems:
        raise SweepError(problems)
    return TrialSpec(config=data)

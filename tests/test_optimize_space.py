"""One config-side Space for `infersweep optimize`: the overrides read once, each point of the walk composed once
(prepare's checks, the dispatcher's trials and the final configuration share it), problems handed back with their
config keys, not as text to split; and the rules that keep it so (no private compose helpers in optimize/, no
axis identity checks there, no function there over 80 lines), checked on the source."""
from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

import pytest

from experiments.config import compose
from experiments.optimize.chain import Chain, pays_off, plan
from experiments.optimize.measurement import EVAL_OFF, point_key
from experiments.optimize.objective import Objective
from experiments.optimize.run import OptimizeError, own_problems, prepare
from experiments.optimize.settings import budget_of, rules_of

from optimize_synthetic import Synthetic, tpot_of

OPTIMIZE = Path(__file__).resolve().parents[1] / "experiments" / "optimize"
GATE_OFF = "optimize.gate.enabled=false"
MAX_LINES = 80


def test_the_walk_composes_each_point_once(tiny_overrides, monkeypatch):
    """prepare (baseline and each value on it), the chain's pairs (each point also as one of an interleaved group),
    the eval-off variants and the final configuration: every distinct point through compose once."""
    composed: collections.Counter = collections.Counter()
    hydra: collections.Counter = collections.Counter()
    fast, raw = compose.Composer.compose_fast, compose.Composer.compose_raw

    def counted_fast(self, fixed, extra):
        composed[tuple(sorted(extra))] += 1
        return fast(self, fixed, extra)

    def counted_raw(self, overrides):
        hydra[tuple(overrides)] += 1
        return raw(self, overrides)

    monkeypatch.setattr(compose.Composer, "compose_fast", counted_fast)
    monkeypatch.setattr(compose.Composer, "compose_raw", counted_raw)
    space, o, disp = prepare([*tiny_overrides, "sweep_name=t-opt-space", "kv_cache=off,contiguous",
                              "attention=eager,sdpa", GATE_OFF])
    synthetic = Synthetic(tpot_of({("kv_cache", "contiguous"): 0.5, ("attention", "sdpa"): 0.9}))
    measured = set()

    def measure(requests):  # the dispatcher's own step (each point to its validated trial), then scripted answers
        for req in requests:
            disp.specs(req)
            measured.update((point_key(p), req.interleaved and len(req.points) > 1) for p in req.points)
        return synthetic(requests)

    r = Chain(space.axes, Objective.parse(o.objective), rules_of(o, False), budget_of(o), measure).run()
    final = disp.spec(r.incumbent)
    assert final.config_hash and r.incumbent == {"kv_cache": "contiguous", "attention": "sdpa"}
    # the walk had what used to compose again: interleaved pairs, eval-off points, the final configuration
    assert any(inter for _, inter in measured) and any(dict(p).get(EVAL_OFF) for p, _ in measured)
    points = {k for k, _ in measured}
    assert len(points) >= 4
    repeated = {k: n for k, n in composed.items() if n > 1}
    assert not repeated, f"composed more than once: {repeated}"
    # every measured point went through compose (the count sees the walk), once
    assert all(composed[tuple(sorted(f"{k}={v}" for k, v in p))] == 1 for p in points)
    assert not {k: n for k, n in hydra.items() if n > 1}  # and Hydra's own compose once per set of choices


def test_problems_come_back_with_their_config_keys(tiny_overrides):
    """engine=native-cpp on the baseline's kv_cache=off: one problem keyed kv_cache.mode (an interaction with the
    KV cache axis, dropped from the value's own problems); pinned, the same problem is the value's own."""
    space, _, disp = prepare([*tiny_overrides, "kv_cache=off,contiguous", "engine=hf,native-cpp", GATE_OFF])
    found = space.problems({"kv_cache": "off", "engine": "native-cpp"})
    assert [p.key for p in found] == ["kv_cache.mode"] and "contiguous" in found[0].why
    assert disp.validate({"kv_cache": "off", "engine": "native-cpp"}) == [str(found[0])]
    assert str(found[0]).startswith("kv_cache.mode: ")  # the text the user reads, unchanged
    assert own_problems("engine", found, space.axes) == []
    assert own_problems("engine", found, {"engine": ["hf", "native-cpp"]}) == found
    # an interleaved trial is the point's own config (same hash), with cluster.interleave set and checked
    one, pair = space.trial({"kv_cache": "contiguous", "engine": "hf"}), space.trial(
        {"kv_cache": "contiguous", "engine": "hf"}, interleave=9)
    assert pair.config_hash == one.config_hash and pair.config["cluster"]["interleave"] == 9
    assert one.config["cluster"]["interleave"] == 0
    with pytest.raises(OptimizeError, match="engine=native-cpp: kv_cache.mode"):
        prepare([*tiny_overrides, "kv_cache=off", "attention=eager,sdpa", "engine=hf,native-cpp", GATE_OFF])


def test_facts_about_axes_are_the_axes_own():
    """The chain asks each axis (engine/axes.py): which values come first, whether the regime decides its payoff."""
    steps = plan({"quant": ["none", "int4-weight", "int8-dynamic", "int8-weight"]}, {"quant": "none"})
    assert steps[0].variants == ("int8-weight", "int4-weight", "int8-dynamic")
    memory = {"regime.decode.measured": "memory"}
    assert pays_off("quant", memory) == (True, "decode is memory-bound: fewer weight bytes per step")
    assert pays_off("speculative", {"regime.decode": "compute"})[0] is False
    assert pays_off("speculative", {"regime.phase": "prefill", "regime": "compute"}) == (None, "")
    assert pays_off("quant", {"regime.phase": "prefill", "regime": "compute"})[0] is False
    assert pays_off("attention", memory) == (None, "")


# --- rules on the source ---------------------------------------------------------------------------------
def _sources(skip: tuple[str, ...] = ()) -> list[Path]:
    return [f for f in sorted(OPTIMIZE.glob("*.py")) if f.name not in skip]


def _module_of(node: ast.ImportFrom, package: str) -> str:
    """The absolute module an import names (`from ..config.compose import x` in experiments.optimize)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def private_config_uses(source: str, package: str = "experiments.optimize") -> list[str]:
    """Private names (`_x`) of experiments.config modules that `source` imports or reads off such a module."""
    out, modules = [], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and _module_of(node, package).startswith("experiments.config"):
            module = _module_of(node, package)
            out += [f"{module}.{a.name}" for a in node.names if a.name.startswith("_")]
            modules |= {a.asname or a.name for a in node.names if not a.name.startswith("_")}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name.startswith("experiments.config")}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if ast.unparse(node.value) in modules:
                out.append(f"{ast.unparse(node.value)}.{node.attr}")
    return out


def test_no_private_config_name_is_used_in_optimize():
    assert {f.name: used for f in _sources() if (used := private_config_uses(f.read_text()))} == {}
    # the check sees each way of reaching one
    assert private_config_uses("from ..config.compose import Composer, _parse\n") == ["experiments.config.compose._parse"]
    assert private_config_uses("from ..config import compose\ncompose._key(o)\n") == ["compose._key"]
    assert private_config_uses("import experiments.config.compose\nexperiments.config.compose._first_lines(e)\n")


def axis_identity_checks(source: str) -> list[str]:
    """`x is axes.QUANT`-style comparisons: a fact about an axis spelled as which axis it is."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr.isupper() and re.search(r"ax[ie]s", ast.unparse(s.value))
                   for s in sides):
                out.append(ast.unparse(node))
    return out


def test_facts_about_axes_are_no_identity_checks_in_optimize():
    assert {f.name: found for f in _sources() if (found := axis_identity_checks(f.read_text()))} == {}
    assert axis_identity_checks("if _axis(k) is axis_registry.QUANT:\n    pass\n")
    assert axis_identity_checks("ok = a is not axes.SPECULATIVE\n")


def long_functions(source: str, limit: int = MAX_LINES) -> list[str]:
    """Functions (methods and nested ones too) longer than `limit` lines, from `def` to their last line."""
    return [f"{n.name}: {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_no_function_in_optimize_is_over_80_lines():
    assert {f.name: long for f in _sources() if (long := long_functions(f.read_text()))} == {}
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES - 1))
    assert long_functions(f"def f():\n{body}") == []  # 80 lines: allowed
    assert long_functions(f"def f():\n{body}    y = 0\n") == ["f: 81 lines"]

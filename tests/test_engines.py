"""The engine contract (engine/engines/): every engine declares what it honours, aliases fold to one
config hash, the cost model asks the engine, no central file names an engine, and the packages import
without cycles (counting type-only imports: a cycle through a type is still a cycle of concepts)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from engine import engines
from engine.config import (ATTENTION_IMPLS, BATCHING_MODES, KV_CACHE_MODES, QUANT_LEVELS, SPECULATIVE_METHODS,
                           KVCacheConfig, AttentionConfig, EngineConfig, ModelConfig, TrialConfig)
from engine.config import replace
from engine.engines import _get
from experiments.config.spec import fold_aliases

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"kv_cache.mode": KV_CACHE_MODES, "batching.mode": BATCHING_MODES, "attention.impl": ATTENTION_IMPLS,
           "quant.level": engines.values("quant.level"), "speculative.method": SPECULATIVE_METHODS,
           "kv_cache.dtype": engines.values("kv_cache.dtype"),
           "quant.kernel": engines.values("quant.kernel"),
           "engine.compile": ("True", "False"), "engine.compile_mode": engines.values("engine.compile_mode"),
           "engine.prefill": ("default", "cpp")}


def _trial(engine: str, **kw) -> TrialConfig:
    t = TrialConfig(model=ModelConfig(name="m", path="tiny://llama"), engine=EngineConfig(backend=engine))
    for k, v in kw.items():
        setattr(t, k, v)
    return t


def test_every_engine_declares_real_keys_values_and_aliases():
    trial = TrialConfig(model=ModelConfig(name="m", path="tiny://llama"))
    assert [e.name for e in engines.all_engines()] == list(engines.NAMES)
    for e in engines.all_engines():
        assert e.summary
        for key, s in e.support.items():
            _get(trial, key)  # a real config key
            assert set(s.values) <= set(ALLOWED[key]), (e.name, key)
            assert s.why
            for alias, target in s.aliases.items():  # an alias runs as a value the engine honours
                assert alias in ALLOWED[key] and target in s.values and alias not in s.values, (e.name, key, alias)


def test_engines_contribute_their_own_axis_values():
    """An axis value that belongs to one engine (llama.cpp's GGUF levels and K/V types, vLLM's fp8 K/V) is in that
    engine's support table only; validation accepts the registry's union, in the registry's order."""
    assert engines.values("quant.level") == QUANT_LEVELS + ("gguf-q8_0", "gguf-q4_0", "gguf-q4_k_m", "gguf-shipped")
    assert engines.values("kv_cache.dtype") == ("auto", "bfloat16", "f32", "f16", "q8_0", "q4_0", "fp8")
    assert not any(v.startswith("gguf-") for v in QUANT_LEVELS)
    from engine.validation import check_trial

    for key, value in (("quant.level", "gguf-q8_0"), ("kv_cache.dtype", "fp8")):  # known, on its engine only
        probs = dict(check_trial(replace(_trial("hf"), key, value), gpu_available=False))
        assert "not allowed" not in probs.get(key, "") and "engine=hf cannot honour" in probs[key]
    msgs = [m for k, m in check_trial(replace(_trial("hf"), "kv_cache.dtype", "q5_1"), gpu_available=False)
            if k == "kv_cache.dtype"]
    assert msgs[0] == "'q5_1' is not allowed; choose one of auto, bfloat16, f32, f16, q8_0, q4_0, fp8"


def test_native_declares_its_compile_modes_and_the_torch_engines_their_kernels():
    """engine.compile_mode's values are engine=native's (every other engine runs dynamic only); quant.kernel's are
    the torch engines' (hf and native both run engine/quant.py's modules), whose rules say which level runs which
    kernel. Validation accepts the registry's union, with the messages the global lists gave."""
    from engine import quant
    from engine.engines.hf import TORCH_KERNELS
    from engine.engines.native import COMPILE_MODES
    from engine.engines.native.compiled import STATIC_MODES
    from engine.validation import check_trial

    native = engines.get("native")
    assert native.support["engine.compile_mode"].values == COMPILE_MODES == ("dynamic", "static", "static-autotune", "cpp")
    assert set(STATIC_MODES) < set(COMPILE_MODES)
    assert all(e.support["engine.compile_mode"].values == ("dynamic",) for e in engines.all_engines() if e is not native)
    assert engines.values("engine.compile_mode") == COMPILE_MODES
    for name in ("hf", "native"):
        assert engines.get(name).support["quant.kernel"].values == TORCH_KERNELS
    assert engines.values("quant.kernel") == TORCH_KERNELS == ("dequant", "int8pack", "gemv", "auto", "gemv-all", "gemv-q8")
    # every kernel is one a level's module runs, or gemv-all (quantize_model's dense GEMV for the full-precision linears)
    assert set(TORCH_KERNELS) == {k for m in quant.MODULES.values() for k in m.KERNELS} | {"gemv-all"}

    def msgs(trial, key):
        return [m for k, m in check_trial(trial, gpu_available=False) if k == key]

    assert msgs(replace(_trial("native"), "engine.compile_mode", "jit"), "engine.compile_mode")[0] == (
        "'jit' is not allowed; choose one of dynamic, static, static-autotune, cpp")
    assert msgs(replace(_trial("hf"), "quant.kernel", "fast"), "quant.kernel")[0] == (
        "'fast' is not allowed; choose one of dequant, int8pack, gemv, auto, gemv-all, gemv-q8")
    for name in ("hf", "native"):  # the kernel x level rules are the torch engines' checks
        t = replace(_trial(name), "quant.kernel", "gemv-all")
        assert msgs(t, "quant.kernel") == []
        assert "gemv-all" in msgs(replace(t, "quant.level", "int8-dynamic"), "quant.kernel")[0]
        t = replace(replace(_trial(name), "quant.level", "int4-weight"), "quant.kernel", "gemv-q8")
        assert msgs(t, "quant.kernel") == []
        assert "not gemv-q8" in msgs(replace(t, "quant.level", "int8-weight"), "quant.kernel")[0]


def test_unsupported_names_engine_key_and_alternatives():
    (msg,) = engines.unsupported(engines.get("hf"), {"kv_cache.mode": "paged", "quant.level": "none"})
    assert msg[0] == "kv_cache.mode" and "engine=hf cannot honour kv_cache.mode=paged" in msg[1]
    assert "off, contiguous" in msg[1]
    assert engines.unsupported(engines.get("native"), {"kv_cache.mode": "paged"}) == []
    # an alias is honoured: it runs as its target
    assert engines.unsupported(engines.get("llamacpp"), {"attention.impl": "sdpa"}) == []
    assert engines.unsupported(engines.get("vllm"), {"kv_cache.mode": "contiguous"}) == []
    with pytest.raises(Exception, match="unknown engine 'bogus'"):
        engines.get("bogus")


def test_aliases_fold_to_the_value_the_engine_runs():
    cfg = {"engine": {"backend": "llamacpp"}, "attention": {"impl": "sdpa"}, "kv_cache": {"mode": "contiguous"}}
    out, folded = fold_aliases(cfg)
    assert folded == {"attention.impl": "eager"} and out["attention"]["impl"] == "eager"
    assert cfg["attention"]["impl"] == "sdpa"  # the input is not mutated
    out, folded = fold_aliases({"engine": {"backend": "vllm"}, "attention": {"impl": "sdpa"},
                                "kv_cache": {"mode": "contiguous"}})
    assert folded == {"kv_cache.mode": "paged"}
    # engines without aliases, and flash on llama.cpp (a value of its own), are left alone
    assert fold_aliases({"engine": {"backend": "hf"}, "attention": {"impl": "sdpa"}})[1] == {}
    assert fold_aliases({"engine": {"backend": "llamacpp"}, "attention": {"impl": "flash"}})[1] == {}
    assert engines.canonical("llamacpp", "attention.impl", "sdpa") == "eager"
    assert engines.canonical("hf", "attention.impl", "sdpa") == "sdpa"


def test_cost_model_asks_the_engine_about_scores_and_kv_bytes():
    eager, sdpa, flash = (AttentionConfig(impl=i) for i in ("eager", "sdpa", "flash"))
    hf, native, cpp, vllm = (engines.get(n) for n in ("hf", "native", "llamacpp", "vllm"))
    # torch: only eager writes the score matrix; llama.cpp: everything but flash; vLLM: never
    assert hf.materializes_scores(_trial("hf", attention=eager)) and not hf.materializes_scores(_trial("hf", attention=sdpa))
    assert native.materializes_scores(_trial("native", attention=eager))
    assert cpp.materializes_scores(_trial("llamacpp", attention=sdpa))
    assert not cpp.materializes_scores(_trial("llamacpp", attention=flash))
    assert not vllm.materializes_scores(_trial("vllm", attention=sdpa))
    # K/V element bytes at kv_cache.dtype (None: the model's dtype)
    assert cpp.kv_element_bytes(_trial("llamacpp", kv_cache=KVCacheConfig(dtype="auto"))) == 2.0  # f16
    assert cpp.kv_element_bytes(_trial("llamacpp", kv_cache=KVCacheConfig(dtype="q8_0"))) == 34 / 32
    assert vllm.kv_element_bytes(_trial("vllm", kv_cache=KVCacheConfig(dtype="fp8"))) == 1.0
    assert hf.kv_element_bytes(_trial("hf")) is None and vllm.kv_element_bytes(_trial("vllm")) is None


def test_kv_dtype_changes_the_predicted_decode_bytes():
    from engine.measure.costmodel import Precision, forward_cost
    from engine.model_facts import inspect

    shape = inspect(ModelConfig(name="m", path="tiny://llama")).shape
    f32 = forward_cost(shape, Precision.of("float32"), 1, 1, 100, True, False)
    q8 = forward_cost(shape, Precision.of("float32", kv_elt_bytes=34 / 32), 1, 1, 100, True, False)
    assert q8.kv_bytes == pytest.approx(f32.kv_bytes * (34 / 32) / 4)
    assert q8.weight_bytes == f32.weight_bytes


# (file, engine name) -> why a module outside engine/engines/ may spell that engine's name as a value
NAME_ALLOWED = {
    # EngineConfig.backend's default: the schema must name its default engine, and the registry's REFERENCE is read
    # from it (engine/config.py cannot ask the registry, which imports the config)
    ("engine/config.py", "hf"): "the default engine",
}


def _non_engine_modules():
    for top in ("engine", "experiments", "cluster"):
        for p in sorted((ROOT / top).rglob("*.py")):
            if not p.relative_to(ROOT).as_posix().startswith("engine/engines/"):
                yield p


def _engine_names_spelled(path: Path) -> list[tuple[int, str, str]]:
    """(line, engine name, literal) for each string literal of `path` (f-string parts included) that is an engine's
    name or chooses one (`engine=NAME`, `backend=NAME`), and each import of an engine's package."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)  # docstrings are prose
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            for name in engines.NAMES:
                if node.value.strip() == name or re.search(rf"\b(engine|backend)\s*=\s*{name}\b", node.value):
                    out.append((node.lineno, name, node.value))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module or ''}.{a.name}" for a in node.names]
            for name in engines.NAMES:
                if any(re.search(rf"(^|\.)engines\.{name}(\.|$)", m) for m in mods):
                    out.append((node.lineno, name, ast.unparse(node)))
    return out


def test_no_module_outside_the_engine_packages_spells_an_engine_name():
    """Validation, the pipeline, measurement, the speculative drafters, analysis and placement ask the registry
    (engine/engines/__init__.py); only an engine's own package spells its name as a value (prose is free)."""
    found = [f"{p.relative_to(ROOT)}:{line}: {lit!r}" for p in _non_engine_modules()
             for line, name, lit in _engine_names_spelled(p) if (p.relative_to(ROOT).as_posix(), name) not in NAME_ALLOWED]
    assert not found, "engine names outside engine/engines/ (ask the registry instead):\n" + "\n".join(found)
    # the check sees what it looks for: the config's default, and a choice spelled in a message
    assert [(n, lit) for _, n, lit in _engine_names_spelled(ROOT / "engine/config.py")] == [("hf", "hf")]
    assert len(list(_non_engine_modules())) > 50


def test_the_engine_name_check_finds_names(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""a docstring may say engine=hf"""\nfrom engine.engines.native.support import x\nif b == "llamacpp":\n'
                 '    msg = f"use engine=vllm, not {b}"\n')
    assert sorted((n, line) for line, n, _ in _engine_names_spelled(p)) == [("llamacpp", 3), ("native", 2), ("vllm", 4)]


def _imports(path: Path, module: str) -> set[str]:
    """Modules of this repo that `module` (at `path`) imports: at module level, inside functions and in
    `if TYPE_CHECKING:` blocks (a type-only import still ties the two modules' concepts together)."""
    tree = ast.parse(path.read_text())
    pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from . import x` imports a module x
    return out


def _graph() -> dict[str, set[str]]:
    files = {}
    for top in ("engine", "experiments", "cluster"):
        for p in (ROOT / top).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = p
    graph = {}
    for mod, p in files.items():
        deps = set()
        for imp in _imports(p, mod):
            while imp and imp not in files:  # `engine.config.X` -> engine.config
                imp = imp.rpartition(".")[0]
            if imp and imp != mod:
                deps.add(imp)
        graph[mod] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan). A package's __init__ importing
    its own submodules is how a package works, not a cycle: a parent package is dropped as a dependency
    of its own submodules."""
    g = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    import sys

    sys.setrecursionlimit(10000)
    for v in list(g):
        if v not in index:
            visit(v)
    return out


def _cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One import cycle through the strongly connected `component`, as a path a -> b -> ... -> a."""
    inside = set(component)
    start = component[0]
    path, seen = [start], {start}

    def walk(v):
        for w in sorted(graph.get(v, ()) & inside):
            if w == start and len(path) > 1:
                return path + [start]
            if w not in seen:
                seen.add(w)
                path.append(w)
                found = walk(w)
                if found:
                    return found
                path.pop()
        return None

    return walk(start) or component


def test_no_import_cycles_among_engine_experiments_cluster():
    graph = _graph()
    cycles = [" -> ".join(_cycle_path(graph, c)) for c in _cycles(graph)]
    assert not cycles, f"{len(cycles)} import cycle(s): " + "; ".join(cycles)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycle_path(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    # imports inside functions, relative ones and type-only ones all count
    tree = {"pkg.a": "from . import b\n", "pkg.b": "def f():\n    from .c import x\n",
            "pkg.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import y\n"}
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        deps = {}
        for mod, text in tree.items():
            p = Path(d) / (mod.split(".")[1] + ".py")
            p.write_text(text)
            deps[mod] = {i for i in _imports(p, mod) if i in tree}
    assert deps == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert _cycles(deps) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_measurement_never_imports_an_engine():
    graph = _graph()
    for mod, deps in graph.items():
        if mod.startswith("engine.measure"):
            assert not any(d.startswith("engine.engines") for d in deps), (mod, deps)


def test_the_contract_declares_what_callers_use():
    """`make_backend`, `reference`, `close` and `generate_greedy_many` are the contract's, each with its default:
    callers call them, never probe for them."""
    from engine.config import EngineError
    from engine.engines.base import Engine, TrialSession

    with pytest.raises(EngineError, match="no logits-level backend"):
        engines.make_backend(None, _trial("vllm"))
    with pytest.raises(EngineError, match="no fp32 reference"):
        Engine().reference(_trial("hf"), None)
    assert type(engines.get(engines.REFERENCE)).reference is not Engine.reference

    class Echo(TrialSession):  # the default batch of greedy requests: one generate_greedy each, in order
        def generate_greedy(self, prompt, max_new_tokens, stop, say):
            return prompt[:max_new_tokens]

    said = []
    assert Echo().generate_greedy_many([([1, 2, 3], 2, []), ([4], 5, [])], said.append) == [[1, 2], [4]]
    assert said == ["generating 1/2 (3 prompt tokens)", "generating 2/2 (1 prompt tokens)"]
    assert Echo().close() is None
    probe = re.compile(r"""(hasattr|getattr)\((session|engine|self\.session|ref_engine)\b""")
    for top in ("engine", "experiments", "cluster"):
        for p in (ROOT / top).rglob("*.py"):
            assert not probe.search(p.read_text()), p

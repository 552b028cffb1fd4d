"""The README cannot drift from the code: its generated tables equal their sources' output, and every
repository path it (or a guide in docs/) names exists. Regenerate the tables with
`python -m experiments.config.catalog --write-readme`."""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from experiments.config import catalog

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
FIX = "run: python -m experiments.config.catalog --write-readme"


def _support_markdown() -> str:
    try:  # the engine registry (engine/engines/), where each engine declares what it honours
        from engine.engines import support_markdown
    except ImportError:  # the axis registry held the table before the engines declared themselves
        from engine.axes import support_markdown
    return support_markdown()


def test_the_group_table_is_generated_from_conf():
    assert catalog.section(README.read_text(), "options") == catalog.options_markdown(), FIX


def test_the_axis_engine_table_is_the_engines_declarations():
    assert catalog.section(README.read_text(), "engines") == _support_markdown(), FIX


def test_the_group_table_lists_every_option_file(tmp_path):
    """options_markdown is read from the files: a new option file shows up, the default is conf's."""
    conf = tmp_path / "conf"
    (conf / "attention").mkdir(parents=True)
    (conf / "model").mkdir()
    for name in ("eager", "sdpa", "paged-flash"):
        (conf / "attention" / f"{name}.yaml").write_text("impl: eager\n")
    (conf / "model" / "tiny.yaml").write_text("name: tiny\n")
    (conf / "config.yaml").write_text("defaults:\n  - trial_schema\n  - _self_\n  - attention: sdpa\n"
                                      "  - optional model: null\n")
    assert catalog.options_markdown(conf).splitlines()[2:] == [
        "| `attention` | sdpa | eager, paged-flash, sdpa |",
        "| `model` | - | tiny |",
    ]


def test_write_readme_replaces_only_the_marked_sections(tmp_path):
    stale = tmp_path / "README.md"
    stale.write_text("intro\n<!-- options:begin -->\nold\n<!-- options:end -->\nmiddle\n"
                     "<!-- engines:begin -->\n<!-- engines:end -->\nend\n")
    assert catalog.main(["--check", "--readme", str(stale)]) == 1
    assert catalog.main(["--write-readme", "--readme", str(stale)]) == 0
    text = stale.read_text()
    assert text.startswith("intro\n<!-- options:begin -->\n| group |") and "\nmiddle\n" in text and text.endswith("end\n")
    assert catalog.section(text, "options") == catalog.options_markdown()
    assert catalog.section(text, "engines") == _support_markdown()
    assert catalog.main(["--check", "--readme", str(stale)]) == 0


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines: move topic detail to docs/ (issue 18: at most ~250)"


# --- every path the README and the guides name exists ---------------------------------------------------
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATHLIKE = re.compile(r"^[\w.<>\-]+(/[\w.<>\-]*)+$")  # a/b, a/b/, a/<name>/c.py; no ':' '~' '$' spaces
ROOT_FILES = re.compile(r"^(Makefile|pyproject\.toml|[A-Z][A-Z_\-]*\.md)$")  # README.md, BENCHMARKS.md
TOP = ("benchmarks", "cluster", "conf", "docs", "engine", "experiments", "mlflow", "tests", ".ci")
CODE_PATH = re.compile(rf"(?<![\w/.~])((?:{'|'.join(re.escape(t) for t in TOP)})/[\w./\-<>]+)")


def _ignore_patterns() -> list[str]:
    gi = ROOT / ".gitignore"
    lines = gi.read_text().splitlines() if gi.exists() else []
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def _git_ignored(path: str, patterns: list[str]) -> bool:
    """Whether `path` is a run-time output the repository ignores (mlflow/artifacts/, .venv/bin/...)."""
    path = path.rstrip("/")
    for pat in patterns:
        p = pat.rstrip("/").lstrip("/")
        if "/" in p:
            if fnmatch.fnmatch(path, p) or path.startswith(p + "/"):
                return True
        elif any(fnmatch.fnmatch(part, p) for part in path.split("/")):
            return True
    return False


def _named_paths(text: str) -> set[str]:
    """Repository paths written in `text`: inline code spans that look like paths, and paths under the
    project's top-level folders inside fenced code blocks."""
    out = set()
    for block in FENCE.findall(text):
        out.update(m.rstrip(".,;:)") for m in CODE_PATH.findall(block))
    patterns = _ignore_patterns()
    for span in SPAN.findall(FENCE.sub("", text)):
        span = span.strip()
        if ROOT_FILES.match(span):
            out.add(span)
        elif PATHLIKE.match(span):
            top = span.split("/", 1)[0]  # rooted in the repository: a project folder, or an ignored output
            if top in TOP or _git_ignored(top, patterns) or (top not in (".", "..") and (ROOT / top).exists()):
                out.add(span)
    return out


def _exists(path: str) -> bool:
    if "<" in path:  # a template (engine/engines/<name>/__init__.py): the folder it goes into must exist
        path = path[:path.index("<")].rsplit("/", 1)[0]
    return (ROOT / path).exists()


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_exists(doc):
    patterns = _ignore_patterns()
    paths = _named_paths(doc.read_text())
    missing = sorted(p for p in paths if not _exists(p) and not _git_ignored(p, patterns))
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    targets = [t.split("#")[0] for t in LINK.findall(doc.read_text()) if "://" not in t and not t.startswith("#")]
    missing = sorted(t for t in targets if t and not (doc.parent / t).exists())
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def test_the_path_check_sees_paths():
    """The checks above are not vacuous: they find the README's paths and would catch a wrong one."""
    paths = _named_paths(README.read_text())
    assert {"engine/pipeline.py", "engine/axes.py", "conf/", "BENCHMARKS.md"} <= paths
    assert "engine/engines/__init__.py" in _named_paths((README.parent / "docs" / "extending.md").read_text())
    assert not _exists("engine/no_such_module.py")
    assert _named_paths("see `engine/gone.py` and\n```bash\npython benchmarks/nope.py --x\n```\n") == \
        {"engine/gone.py", "benchmarks/nope.py"}
    assert _git_ignored("mlflow/artifacts/", _ignore_patterns()) and _git_ignored(".venv/bin/infersweep", _ignore_patterns())
    assert not _git_ignored("engine/pipeline.py", _ignore_patterns())


# --- the README's examples are real -----------------------------------------------------------------------
def _commands(text: str, prefix: str) -> list[list[str]]:
    """The argument lists of the `prefix ...` commands in the fenced blocks of `text` (comments dropped)."""
    import shlex

    out = []
    for block in FENCE.findall(text):
        for line in block.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith(prefix + " "):
                out.append(shlex.split(line.split("  #")[0], comments=True)[len(prefix.split()):])
    return out


def test_the_override_examples_expand_and_validate():
    """Every `infersweep sweep|run ...` example of the README is a valid sweep here, except for an engine
    that is not installed (refused with its setup command) and placeholder paths."""
    from experiments.config.compose import SweepError, expand

    examples = [c for c in _commands(README.read_text(), "infersweep sweep") + _commands(README.read_text(), "infersweep run")
                if not any("/path/to" in a for a in c) and "kv_cache=bogus" not in c]
    assert len(examples) >= 4
    for overrides in examples:
        overrides = [a for a in overrides if not a.startswith("--")]
        try:
            assert expand(overrides)
        except SweepError as e:
            real = [p for p in e.problems if "make setup-" not in p]
            assert not real, (overrides, real)


def test_the_bad_input_example_is_what_the_cli_prints(capsys):
    from experiments.cli import main

    text = README.read_text()
    block = next(b for b in FENCE.findall(text) if "$ infersweep sweep kv_cache=bogus" in b)
    lines = block.strip("`\n").splitlines()
    command, expected = lines[0].removeprefix("$ infersweep "), lines[1:]
    import shlex

    assert main(shlex.split(command)) == 2
    assert capsys.readouterr().err.strip().splitlines() == expected

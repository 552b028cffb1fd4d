"""The commands infersweep prints for the user to type work as typed, also in a shell without the venv on PATH
(what `make sweep` leaves the user in)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.cli import main
from experiments.invocation import typed_command
from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
BARE_PATH = "/usr/local/bin:/usr/bin:/bin"  # a fresh login shell's PATH: no activated venv
SCRIPT = Path(sys.executable).parent / "infersweep"
needs_script = pytest.mark.skipif(not SCRIPT.is_file(), reason=f"no console script beside {sys.executable}")


def _typed(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` as a user types it into a shell at `cwd` whose PATH has no venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = BARE_PATH
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@needs_script
def test_without_the_venv_on_path_the_script_is_named_by_its_path_and_runs():
    assert subprocess.run(["bash", "-c", "command -v infersweep"], env={"PATH": BARE_PATH}).returncode != 0
    cmd = typed_command("ui", cwd=ROOT, path=BARE_PATH)
    if SCRIPT.absolute().is_relative_to(ROOT):
        assert cmd == f"{SCRIPT.absolute().relative_to(ROOT)} ui"  # .venv/bin/infersweep ui
    r = _typed(cmd + " --help", ROOT)
    assert r.returncode == 0, r.stderr
    assert "start the MLflow UI" in r.stdout or "--port" in r.stdout


@needs_script
def test_outside_the_repo_the_path_is_absolute(tmp_path):
    cmd = typed_command("ui", cwd=tmp_path, path=BARE_PATH)
    assert cmd == f"{SCRIPT.absolute()} ui"
    assert _typed(cmd + " --help", tmp_path).returncode == 0


@needs_script
def test_with_the_venv_on_path_the_bare_name_is_enough():
    assert typed_command("ui", path=f"{SCRIPT.parent}:{BARE_PATH}") == "infersweep ui"
    # another `infersweep` earlier on PATH is not this one: name ours by its path
    assert typed_command("ui", cwd=ROOT, path=f"/nonexistent:{BARE_PATH}") != "infersweep ui"


def test_arguments_are_quoted_for_the_shell():
    cmd = typed_command("ui", "tracking.uri=sqlite:////tmp/a b/mlflow.db", cwd=ROOT, path=BARE_PATH)
    assert cmd.endswith(" ui 'tracking.uri=sqlite:////tmp/a b/mlflow.db'")


def test_the_sweep_ends_with_a_dashboard_command_that_runs_as_typed(tracking_overrides, monkeypatch, capsys):
    store = list(tracking_overrides)  # the session's store (creating one costs seconds)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", BARE_PATH)  # as under `make sweep`, which runs .venv/bin/infersweep by its path
    assert main(["sweep", "--in-process", "--force", "sweep_name=t-hint", *TINY, *store]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("open the dashboard with:")]
    cmd = line.removeprefix("open the dashboard with:").split("   (")[0].strip()
    words = shlex.split(cmd)
    assert words[0] != "infersweep", line  # not on this PATH: it would be "command not found"
    assert words[-3:] == ["ui", *store]  # the same store as the sweep, so the UI shows this experiment
    r = _typed(cmd + " --help", ROOT)
    assert r.returncode == 0, r.stderr

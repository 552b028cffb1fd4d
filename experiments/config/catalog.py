"""The generated parts of README.md: the config groups of `conf/` with their options, and the axis x engine
table. Both are read from their single source (the files in `conf/`, the engine registry), so the README
cannot drift from them: `tests/test_readme.py` checks that the README holds exactly this output between
the marker comments, and

    python -m experiments.config.catalog --write-readme

rewrites those sections after a change (`--check` only reports whether they are stale)."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

from .compose import PROJECT_ROOT, conf_dir

README = PROJECT_ROOT / "README.md"


def groups(conf: Path | None = None) -> dict[str, list[str]]:
    """{group: sorted option names} for every folder of `conf/` that holds option files."""
    conf = conf or conf_dir()
    out = {}
    for d in sorted(p for p in conf.iterdir() if p.is_dir()):
        options = sorted(f.stem for f in d.glob("*.yaml"))
        if options:
            out[d.name] = options
    return out


def defaults(conf: Path | None = None) -> dict[str, str]:
    """{group: the option conf/config.yaml picks} (an `optional` group chosen as null is left out)."""
    conf = conf or conf_dir()
    out = {}
    for entry in yaml.safe_load((conf / "config.yaml").read_text()).get("defaults", []):
        if not isinstance(entry, dict):  # `trial_schema`, `_self_`
            continue
        for key, value in entry.items():
            group = key.split()[-1]  # "optional experiment" -> "experiment"
            if value is not None and not group.startswith("override"):
                out[group] = str(value)
    return out


def options_markdown(conf: Path | None = None) -> str:
    """The README's group table: `| \\`group\\` | default | options |`, one row per config group."""
    picked = defaults(conf)
    rows = ["| group | default | options |", "|---|---|---|"]
    for group, options in groups(conf).items():
        rows.append(f"| `{group}` | {picked.get(group, '-')} | {', '.join(options)} |")
    return "\n".join(rows)


def engines_markdown() -> str:
    """The axis x engine table, from the engine registry (`engine.engines`; `engine.axes` before the move)."""
    try:
        from engine.engines import support_markdown
    except ImportError:
        from engine.axes import support_markdown
    return support_markdown()


SECTIONS = {"options": options_markdown, "engines": engines_markdown}


def section(text: str, name: str) -> str | None:
    """What `text` holds between `<!-- NAME:begin -->` and `<!-- NAME:end -->` (stripped), or None."""
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)\n?<!-- {name}:end -->", text, re.S)
    return None if m is None else m.group(1).strip()


def render(text: str) -> str:
    """`text` with every generated section replaced by its current output."""
    for name, make in SECTIONS.items():
        if section(text, name) is None:
            raise ValueError(f"README.md has no `<!-- {name}:begin -->` ... `<!-- {name}:end -->` markers")
        body = make()
        text = re.sub(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)",
                      lambda m: m.group(1) + body + "\n" + m.group(2), text, flags=re.S)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.config.catalog", description=__doc__.split("\n\n")[0])
    p.add_argument("--write-readme", action="store_true", help="rewrite the generated sections of README.md")
    p.add_argument("--check", action="store_true", help="exit 1 if README.md's generated sections are stale")
    p.add_argument("--readme", type=Path, default=README)
    args = p.parse_args(argv)
    if not (args.write_readme or args.check):
        for name, make in SECTIONS.items():
            print(f"<!-- {name}:begin -->\n{make()}\n<!-- {name}:end -->\n")
        return 0
    old = args.readme.read_text()
    new = render(old)
    if args.check:
        print(f"{args.readme}: " + ("up to date" if new == old else "stale; run python -m experiments.config.catalog "
                                                                       "--write-readme"))
        return 0 if new == old else 1
    if new != old:
        args.readme.write_text(new)
    print(f"{args.readme}: " + ("rewritten" if new != old else "already up to date"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

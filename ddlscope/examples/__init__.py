"""The example files that ship with ddlscope: cluster files, run configs, a sweep grid, scripts.

They lie in this package (``ddlscope/examples/``), so an installed wheel has them as well as a
source checkout. ``ddlscope examples`` lists them and ``ddlscope examples --copy DIR`` writes
them to a folder to edit. Where a command reads a TOML file, a relative path ``examples/NAME``
that does not exist in the current folder is read from the shipped copy (:func:`resolve_example`),
so the README's commands (``ddlscope recommend --cluster examples/cluster-2x4xa100.toml``) work
from any folder.
"""

from __future__ import annotations

import ast
import filecmp
import json
import re
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ddlscope.errors import UserError

EXAMPLES_DIR = Path(__file__).resolve().parent
"""The folder the examples ship in (inside the installed ``ddlscope`` package)."""
EXAMPLE_SUFFIXES = (".toml", ".py")
"""File types that are examples; ``__init__.py`` (this module) is not one."""
EXAMPLES_PREFIX = "examples"
"""The folder name the docs use for the examples: ``examples/NAME`` resolves to a shipped one."""

# top-level TOML tables -> what the file is for (the first match wins)
_KINDS = (({"cluster"}, "cluster file"), ({"run"}, "run config"), ({"base", "axes"}, "sweep grid"))
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)])\.\s+(?!\d)")  # "vs. 2" and "ch. 3.4" do not end one


@dataclass(frozen=True)
class Example:
    """One shipped example file.

    Attributes:
        name: file name, e.g. ``"cluster-2x4xa100.toml"``; ``examples/<name>`` in the docs.
        kind: ``"cluster file"``, ``"run config"``, ``"sweep grid"``, ``"script"`` or ``"file"``.
        summary: the first sentence of the file's leading comment (TOML) or docstring (Python);
            ``""`` when it has none.
        path: where it lies in the installed package.
    """

    name: str
    kind: str
    summary: str
    path: Path


def _kind(path: Path) -> str:
    if path.suffix == ".py":
        return "script"
    tables = set(tomllib.loads(path.read_text(encoding="utf-8")))
    return next((kind for keys, kind in _KINDS if keys <= tables), "file")


def _summary(path: Path) -> str:
    """The first sentence of the file's leading comment (TOML) or docstring (Python)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        paragraph = (ast.get_docstring(ast.parse(text)) or "").split("\n\n")[0]
    else:
        lines = []
        for line in text.splitlines():
            if not line.startswith("#") or (lines and not line.strip("# ")):
                break  # the leading comment's first paragraph ends at code or an empty comment line
            lines.append(line.strip("# "))
        paragraph = " ".join(lines)
    return _SENTENCE_END.split(" ".join(paragraph.split()), maxsplit=1)[0]


def list_examples() -> list[Example]:
    """The shipped examples, sorted by name.

    Raises:
        tomllib.TOMLDecodeError: a shipped TOML file is broken (a packaging bug, not bad input).
    """
    return [Example(p.name, _kind(p), _summary(p), p) for p in _example_files()]


def _example_files() -> list[Path]:
    return sorted(p for p in EXAMPLES_DIR.iterdir()
                  if p.is_file() and p.suffix in EXAMPLE_SUFFIXES and p.name != "__init__.py")


def example_names() -> list[str]:
    """The file names of the shipped examples, sorted."""
    return [p.name for p in _example_files()]


def example_path(name: str) -> Path:
    """The installed path of the shipped example ``name`` (``"peers-tbs.toml"`` or ``"examples/peers-tbs.toml"``).

    Raises:
        UserError: no shipped example has that name (the message lists those that exist).
    """
    bare = Path(name)
    if bare.parts[:1] == (EXAMPLES_PREFIX,) and len(bare.parts) == 2:
        bare = Path(bare.parts[1])
    names = example_names()
    if len(bare.parts) != 1 or bare.name not in names:
        raise UserError(f"no example named {name!r}; allowed: {', '.join(names)}")
    return EXAMPLES_DIR / bare.name


def resolve_example(path: str | Path) -> Path:
    """``path`` itself when it exists; else, for a relative ``examples/NAME`` naming a shipped
    example, that example's installed path; else ``path`` unchanged (the caller reports it missing).

    This lets the commands in the docs (``--cluster examples/cluster-2x4xa100.toml``) run from any
    folder of a wheel install, while a user's own ``./examples/NAME`` always wins.
    """
    path = Path(path)
    if path.exists() or path.is_absolute() or len(path.parts) != 2 or path.parts[0] != EXAMPLES_PREFIX:
        return path
    return EXAMPLES_DIR / path.name if path.name in example_names() else path


def copy_examples(dest: str | Path, names: list[str] | None = None, overwrite: bool = False) -> list[Path]:
    """Copy shipped examples into the folder ``dest`` (created with its parents), to edit and run.

    Args:
        dest: target folder; the files keep their names.
        names: which examples (file names, as :func:`example_names`); ``None`` or empty: all of them.
        overwrite: replace files in ``dest`` that differ from the shipped ones; without it such a
            file stops the copy before anything is written. Identical files are left as they are.

    Returns:
        The paths in ``dest`` of the requested examples, sorted by name.

    Raises:
        UserError: an unknown name, ``dest`` is a file, a differing file is in the way (without
            ``overwrite``), or ``dest`` cannot be written (the message has the path).
    """
    dest = Path(dest)
    sources = [example_path(n) for n in names] if names else _example_files()
    sources = sorted(set(sources))
    if dest.exists() and not dest.is_dir():
        raise UserError(f"{dest} is a file; allowed: a folder to copy the examples into (created if missing)")
    targets = [dest / s.name for s in sources]
    folders = [t for t in targets if t.is_dir()]
    if folders:
        raise UserError(f"{', '.join(str(t) for t in folders)} is a folder; allowed: another destination folder")
    clashing = [t for s, t in zip(sources, targets) if t.exists() and not filecmp.cmp(s, t, shallow=False)]
    if clashing and not overwrite:
        raise UserError(f"{', '.join(str(t) for t in clashing)} already exist(s) and differ(s) from the shipped "
                        f"example; allowed: another folder, or --overwrite to replace them")
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for source, target in zip(sources, targets):
            if not (target.exists() and filecmp.cmp(source, target, shallow=False)):
                shutil.copyfile(source, target)
    except OSError as err:
        raise UserError(f"cannot write the examples to {dest}: {err.strerror or err}") from None
    return targets


def examples_command(copy_to: Path | None = None, names: list[str] | None = None, overwrite: bool = False,
                     as_json: bool = False) -> str:
    """What ``ddlscope examples`` prints: one line per shipped example (name, kind, summary), or,
    with ``copy_to``, the files copied there; ``as_json``: the same as one JSON document (a list of
    ``{name, kind, summary, path}``, or ``{"copied": [paths], "to": folder}``).

    Raises:
        UserError: as :func:`copy_examples` (unknown name, clashing file, unwritable folder), or
            ``overwrite`` without ``copy_to``.
    """
    if copy_to is None and overwrite:
        raise UserError("--overwrite only applies with --copy DIR; allowed: ddlscope examples --copy DIR --overwrite")
    if copy_to is None:
        chosen = {example_path(n).name for n in names or []}
        rows = [e for e in list_examples() if not chosen or e.name in chosen]
        if as_json:
            return json.dumps([{"name": e.name, "kind": e.kind, "summary": e.summary, "path": str(e.path)}
                               for e in rows], indent=2)
        width = max(len(e.name) for e in rows)
        lines = [f"{e.name:<{width}}  {e.kind:<12}  {e.summary}" for e in rows]
        lines.append(f"(in {EXAMPLES_DIR}; `ddlscope examples --copy DIR` copies them out; a path "
                     f"examples/NAME that does not exist here is read from there)")
        return "\n".join(lines)
    written = copy_examples(copy_to, names, overwrite)
    if as_json:
        return json.dumps({"copied": [str(p) for p in written], "to": str(copy_to)}, indent=2)
    return "\n".join([f"copied {len(written)} example(s) to {copy_to}:"] + [f"  {p}" for p in written])

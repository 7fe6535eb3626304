"""The package as it ships: the wheel's files and requirements, and the examples that come with it."""

from __future__ import annotations

import email.parser
import json
import os
import re
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import ddlscope
from ddlscope.errors import UserError
from ddlscope.examples import (EXAMPLE_SUFFIXES, EXAMPLES_DIR, copy_examples, example_names, examples_command,
                               list_examples, resolve_example)
from ddlscope.modeling.cluster import load_cluster

REPO = Path(__file__).resolve().parents[1]
# a path the docs give as examples/NAME (not a glob such as examples/cluster-*.toml)
DOC_EXAMPLE = re.compile(r"(?<![\w/.-])(?:\.\./)?(?:ddlscope/)?examples/([\w.-]+\.(?:toml|py))")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel scripts/build_wheel.sh builds from this checkout (with this interpreter's setuptools)."""
    pytest.importorskip("setuptools", minversion="68", reason="building the wheel needs setuptools >= 68")
    dist = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, PYTHON=sys.executable, BUILD_ISOLATION="0")
    out = subprocess.run(["bash", str(REPO / "scripts" / "build_wheel.sh"), str(dist)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return zipfile.ZipFile(out.stdout.strip())


def _metadata(wheel: zipfile.ZipFile):
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    return email.parser.Parser().parsestr(wheel.read(name).decode())


# ------------------------------------------------------------------------------------ the wheel
def test_the_wheel_ships_every_example_and_no_tests(wheel):
    names = set(wheel.namelist())
    shipped = {p.name for p in EXAMPLES_DIR.iterdir() if p.suffix in EXAMPLE_SUFFIXES}
    assert {"cluster-2x4xa100.toml", "peers-tbs.toml", "dmoe-server-killed.toml"} <= shipped
    assert {f"ddlscope/examples/{n}" for n in shipped} <= names
    top = {n.split("/")[0] for n in names}
    assert top == {"ddlscope", f"ddlscope-{ddlscope.__version__}.dist-info"}  # no tests/, docs/, benchmarks/
    assert not [n for n in names if n.endswith((".pyc", "conftest.py")) or "/tests/" in n or "__pycache__" in n]


def test_the_wheel_requires_ranges_that_hold_the_installed_torch_and_hivemind(wheel):
    meta = _metadata(wheel)
    assert meta["Version"] == ddlscope.__version__
    requires = {r.name: r for r in map(Requirement, meta.get_all("Requires-Dist")) if r.marker is None}
    torch_range = requires["torch"].specifier
    assert not any(s.operator == "==" for s in torch_range), f"torch is pinned exactly: {torch_range}"
    assert torch_range.contains(version("torch").split("+")[0])  # a local build (+cpu, +cu130) is kept
    assert requires["hivemind"].specifier.contains(version("hivemind"))


# ------------------------------------------------------------------------------------ the examples
def test_every_example_has_a_kind_and_a_summary_and_the_cluster_files_load():
    examples = list_examples()
    assert [e.name for e in examples] == sorted(p.name for p in EXAMPLES_DIR.iterdir()
                                                if p.suffix in EXAMPLE_SUFFIXES and p.name != "__init__.py")
    assert all(e.kind != "file" and e.summary for e in examples), [(e.name, e.kind, e.summary) for e in examples]
    clusters = [e for e in examples if e.kind == "cluster file"]
    assert len(clusters) >= 5
    for e in clusters:
        load_cluster(e.path)


def test_copy_examples_writes_them_once_and_refuses_to_clobber_an_edited_file(tmp_path):
    dest = tmp_path / "mine" / "examples"
    written = copy_examples(dest)
    assert [p.name for p in written] == example_names()
    assert all(p.read_bytes() == (EXAMPLES_DIR / p.name).read_bytes() for p in written)
    assert copy_examples(dest) == written  # again: identical files are left as they are

    edited = dest / "peers-tbs.toml"
    edited.write_text("# mine\n")
    (dest / "cluster-2x4xa100.toml").unlink()
    with pytest.raises(UserError, match=r"peers-tbs\.toml already exist.*--overwrite"):
        copy_examples(dest)
    assert edited.read_text() == "# mine\n" and not (dest / "cluster-2x4xa100.toml").exists()  # nothing written
    assert copy_examples(dest, ["cluster-2x4xa100.toml"]) == [dest / "cluster-2x4xa100.toml"]
    copy_examples(dest, ["examples/peers-tbs.toml"], overwrite=True)
    assert edited.read_bytes() == (EXAMPLES_DIR / "peers-tbs.toml").read_bytes()


@pytest.mark.parametrize("call, message", [
    (lambda d: copy_examples(d, ["nope.toml"]), r"no example named 'nope\.toml'; allowed: cluster-2x4xa100\.toml"),
    (lambda d: copy_examples(d / "file.txt"), r"is a file; allowed: a folder"),
    (lambda d: examples_command(None, None, overwrite=True), r"--overwrite only applies with --copy"),
])
def test_bad_requests_get_one_clear_message(tmp_path, call, message):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(UserError, match=message):
        call(tmp_path)


def test_examples_command_lists_every_example_and_reports_a_copy(tmp_path):
    listing = examples_command()
    assert all(re.search(rf"^{re.escape(n)} +\S", listing, re.M) for n in example_names())
    assert "cluster-2x4xa100.toml  cluster file" in examples_command(names=["cluster-2x4xa100.toml"])
    copied = examples_command(tmp_path / "ex", ["peers-tbs.toml"])
    assert copied.splitlines() == [f"copied 1 example(s) to {tmp_path / 'ex'}:", f"  {tmp_path / 'ex' / 'peers-tbs.toml'}"]
    as_json = json.loads(examples_command(names=["examples/peers-tbs.toml"], as_json=True))
    assert as_json == [{"name": "peers-tbs.toml", "kind": "sweep grid", "summary": as_json[0]["summary"],
                        "path": str(EXAMPLES_DIR / "peers-tbs.toml")}] and as_json[0]["summary"]
    assert json.loads(examples_command(tmp_path / "ex2", ["peers-tbs.toml"], as_json=True)) == {
        "copied": [str(tmp_path / "ex2" / "peers-tbs.toml")], "to": str(tmp_path / "ex2")}


def test_examples_slash_name_resolves_to_the_shipped_file_unless_one_is_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_example("examples/peers-tbs.toml") == EXAMPLES_DIR / "peers-tbs.toml"
    for other in ("examples/missing.toml", "peers-tbs.toml", "other/peers-tbs.toml", "examples/__init__.py"):
        assert resolve_example(other) == Path(other)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "peers-tbs.toml").write_text("# mine\n")
    assert resolve_example("examples/peers-tbs.toml") == Path("examples/peers-tbs.toml")


def test_toml_reading_commands_find_the_examples_the_docs_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = Path("examples/cluster-2x4xa100.toml")
    assert load_cluster(path) == load_cluster(EXAMPLES_DIR / path.name)


def test_every_example_the_docs_name_ships():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = {(page.name, m) for page in pages for m in DOC_EXAMPLE.findall(page.read_text())}
    assert {n for _, n in named} >= {"cluster-2x4xa100.toml", "peers-tbs.toml"}
    missing = sorted((page, n) for page, n in named if n not in example_names())
    assert not missing, f"named in the docs but not shipped in ddlscope/examples/: {missing}"

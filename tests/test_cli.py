"""The command line's shared conventions: help texts shown literally, ``--json`` as one strict JSON
document on stdout, one name per option across commands, tables as wide as the terminal."""

from __future__ import annotations

import json
import re

import pytest
import typer
from typer.testing import CliRunner

from ddlscope.cli import app, strict_json
from ddlscope.store.db import ResultsStore
from tests.conftest import tiny_run
from tests.test_sweep_analysis import _matchmaking_run, _sweep

BRACKETED = re.compile(r"\[[A-Za-z_.]+\]")  # "[run]", "[dmoe]", "[cluster.device]": TOML tables named in help


def _invoke(*args, columns: int = 100):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": str(columns)})


def _strict_loads(text: str):
    """json.loads that refuses NaN and Infinity, which strict JSON does not have."""
    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def _commands(group=None, path=()):
    """(command path, click command) of every command, subcommands of groups included."""
    group = group or typer.main.get_command(app)
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def _width(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


# ---------------------------------------------------------------------- help
def test_every_help_shows_the_tables_it_names_literally():
    seen = 0
    for path, cmd in _commands():
        result = _invoke(*path, "--help")
        assert result.exit_code == 0, (path, result.output)
        texts = [cmd.help or ""] + [p.help or "" for p in cmd.params if not getattr(p, "hidden", False)]
        for token in {t for text in texts for t in BRACKETED.findall(text)}:
            assert token in result.output, (path, token, result.output)
            seen += 1
    assert seen >= 5  # run, suite, sweep, serve-experts, validate name tables
    assert "TOML run config ([run], [distributed] and the models' own tables)" in \
        " ".join(_invoke("run", "--help").output.split())


def test_validate_help_names_every_preset():
    from ddlscope.experiments.validate import PRESETS

    grid = next(p for p in dict(_commands())[("validate",)].params if p.name == "grid")
    assert grid.help.endswith("preset: " + ", ".join(PRESETS)), grid.help


def test_one_name_per_option_with_units_and_old_names_hidden():
    flags: dict[str, set[str]] = {}
    for path, cmd in _commands():
        for p in cmd.params:
            if p.param_type_name != "option" or p.hidden or p.name in ("help",):
                continue
            concept = "json" if p.name in ("as_json", "json_", "json_out") else p.name
            flags.setdefault(concept, set()).add(p.opts[0])
            if "seconds" in (p.help or "") and not p.is_flag:
                assert p.opts[0].endswith("-s"), (path, p.opts[0], p.help)
    assert {c: f for c, f in flags.items() if len(f) > 1} == {}
    assert flags["matchmaking_time_s"] == {"--matchmaking-time-s"} and flags["json"] == {"--json"}
    assert flags["loader_workers"] == {"--loader-workers"} and flags["data_root"] == {"--data-root"}
    assert flags["run_id"] == {"--run-id"}
    calibrate = _invoke("calibrate", "--help").output
    assert "--matchmaking-time-s" in calibrate and not re.search(r"--matchmaking-time(?!-s)", calibrate)


def test_an_old_option_name_still_works_with_a_note_and_not_together_with_the_new(tmp_path):
    old = _invoke("data", "synthetic", "mnist", "--train-size", 4, "--test-size", 2, "--root", tmp_path / "old")
    assert old.exit_code == 0, old.output
    assert "note: --root is deprecated; it is now --data-root" in old.stderr
    assert (tmp_path / "old").is_dir() and str(tmp_path / "old") in old.stdout
    both = _invoke("data", "synthetic", "mnist", "--root", tmp_path / "a", "--data-root", tmp_path / "b")
    assert "--root is the old name of --data-root" in str(both.exception)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------------- --json
def test_strict_json_writes_unknown_figures_as_null():
    text = strict_json({"nan": float("nan"), "inf": [float("inf"), -float("inf")], "ok": 1.5, "n": 2})
    assert _strict_loads(text) == {"nan": None, "inf": [None, None], "ok": 1.5, "n": 2}


def test_json_of_the_listing_and_planning_commands():
    models = _strict_loads(_invoke("models", "--json").stdout)
    assert "single" in {m["name"] for m in models}
    presets = _strict_loads(_invoke("sweep", "--list-presets", "--json").stdout)
    assert "local" in presets
    plan = _invoke("sweep", "--preset", "local", "--dry-run", "--json", "--db", "/nonexistent/ddlscope.db")
    assert plan.exit_code == 0, plan.output
    plan = _strict_loads(plan.stdout)
    assert plan["sweep"] == "local" and plan["cells"] and plan["cells"][0]["stored"] == "-"
    assert plan["estimated_remaining_s"] == pytest.approx(sum(c["estimated_s"] for c in plan["cells"]))
    listing = _strict_loads(_invoke("examples", "--json").stdout)
    assert set(listing[0]) == {"name", "kind", "summary", "path"}
    assert "swarm-churn.toml" in {e["name"] for e in listing}
    suite = _invoke("suite", "local", "--dry-run", "--json")
    assert suite.exit_code == 0, suite.output
    assert {"label", "strategy", "batch_size", "microbatches"} <= set(_strict_loads(suite.stdout)["cells"][0])


def test_json_of_report_sweep_report_and_matchmaking(tmp_path):
    with ResultsStore(tmp_path / "results" / "r.db") as store:
        ids, failed = _sweep(store)
        mm_run = _matchmaking_run(store, group="mm")
        db = store.path
    report = _invoke("report", *ids[:2], "--db", db, "--json")
    assert report.exit_code == 0, report.output
    doc = _strict_loads(report.stdout)
    assert [r["run_id"] for r in doc["runs"]] == ids[:2] and doc["report"].endswith("report.html")
    assert "report: " in report.stderr  # notes, the table and the report's path go to stderr
    sweep = _strict_loads(_invoke("sweep-report", "s", "--db", db, "--json").stdout)
    assert sweep["sweep"] == "s" and {"peers", "matchmaking", "failed"} <= set(sweep)
    assert [f["run_id"] for f in sweep["failed"]] == [failed]
    out = tmp_path / "mm.json"
    mm = _invoke("matchmaking", mm_run, "--db", db, "--json", "--out", out)
    assert mm.exit_code == 0, mm.output
    assert _strict_loads(mm.stdout) == _strict_loads(out.read_text())
    assert _strict_loads(mm.stdout)["run_ids"] == [mm_run]
    markdown = _invoke("matchmaking", mm_run, "--db", db)
    assert "set matchmaking_time_s to about 1.5 s" in markdown.stdout and not out.with_name("x").exists()


def test_run_json_is_the_stored_record_and_runs_lists_it(env_data, db_path, monkeypatch):
    monkeypatch.setenv("DDLSCOPE_SHARE_CORES", "1")  # the cores may be leased by a run of another test
    sets = [a for k, v in tiny_run(sample_budget=64).items() for a in ("--set", f"{k}={json.dumps(v)}")]
    result = _invoke("run", *sets, "--db", db_path, "--no-progress", "--json")
    assert result.exit_code == 0, result.output
    record = _strict_loads(result.stdout)
    assert record["status"] == "completed" and record["config"]["model"] == "tiny_cnn"
    assert f"run {record['run_id']} completed" in result.stderr
    listed = _strict_loads(_invoke("runs", "--db", db_path, "--json").stdout)
    assert [r["run_id"] for r in listed] == [record["run_id"]]


def test_sweep_json_is_the_cells_outcomes(env_data, tmp_path, monkeypatch):
    monkeypatch.setenv("DDLSCOPE_SHARE_CORES", "1")
    grid = tmp_path / "g.toml"
    base = "".join(f"{k} = {json.dumps(v)}\n" for k, v in tiny_run(sample_budget=64).items() if k != "batch_size")
    grid.write_text(f"[base]\n{base}[axes]\nbatch_size = [16]\n")
    db = tmp_path / "r.db"
    result = _invoke("sweep", grid, "--db", db, "--no-progress", "--json")
    assert result.exit_code == 0, result.output
    doc = _strict_loads(result.stdout)
    assert doc["sweep"] == "g" and doc["counts"] == {"completed": 1, "failed": 0, "skipped": 0}
    [cell] = doc["cells"]
    assert cell["status"] == "completed" and cell["label"].startswith("bs16")
    assert "sweep g: 1 completed" in result.stderr
    again = _strict_loads(_invoke("sweep", grid, "--db", db, "--json").stdout)
    assert again["cells"][0]["status"] == "skipped" and again["cells"][0]["run_id"] == cell["run_id"]


# ---------------------------------------------------------------------- width
def test_tables_fit_a_narrow_terminal(tmp_path):
    db = tmp_path / "r.db"
    with ResultsStore(db) as store:
        ids = [store.create_run(f"a-rather-long-run-name-{i}" * 3, "collaborative", {}, "group-" * 8) for i in range(3)]
        for run_id in ids:
            store.finish_run(run_id, "failed", "worker 0 exited with code 1: " + "a long reason " * 20)
    runs = _invoke("runs", "--db", db, columns=80)
    assert runs.exit_code == 0 and all(r in runs.stdout for r in ids), runs.output
    assert _width(runs.stdout) <= 80, runs.stdout
    assert _width(_invoke("runs", "--db", db, columns=160).stdout) > 80  # the width follows the terminal
    plan = _invoke("sweep", "--preset", "local", "--dry-run", "--db", db, columns=80)
    assert plan.exit_code == 0 and _width(plan.stdout) <= 80, plan.stdout

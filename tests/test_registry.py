"""The distribution-model registry: one descriptor per model, and nothing outside a model's own
files decides by its name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from ddlscope import distribution
from ddlscope.config import validate_config
from ddlscope.errors import UserError
from ddlscope.strategies.base import Strategy

PACKAGE = Path(__file__).resolve().parents[1] / "ddlscope"


def test_every_model_has_a_complete_descriptor():
    models = distribution.all_models()
    assert [m.name for m in models][:1] == ["single"]
    assert {"single", "ddp", "fsdp", "gpipe", "1f1b", "collaborative"} <= set(distribution.names())
    for m in models:
        cls = m.strategy_class()
        assert issubclass(cls, Strategy) and cls.name == m.name, m.name
        assert m.summary and m.measures and m.predicts
        assert m.launcher in distribution.LAUNCHERS


def test_unknown_model_is_refused_with_the_registered_names():
    with pytest.raises(UserError, match="allowed: single, ddp"):
        distribution.get("horovod")
    with pytest.raises(UserError, match="strategy: unknown distribution model 'horovod'; allowed: single"):
        validate_config({"strategy": "horovod"})


def test_rules_come_from_the_descriptor():
    pipeline = distribution.get("gpipe")
    assert pipeline.data_parallel_size(4) == 1 and pipeline.global_batch_size(32, 4) == 32
    assert distribution.get("ddp").global_batch_size(32, 4) == 128
    assert distribution.get("collaborative").global_batch_size(32, 4, {"target_batch_size": 512}) == 512
    assert distribution.get("single").check_workers(2) is not None
    assert distribution.get("single").check_workers(1) is None
    cfg = validate_config({"strategy": "collaborative", "peers": 2, "batch_size": 8,
                           "collaborative": {"target_batch_size": 64}, "vcpus_per_peer": 1})
    assert cfg.global_batch_size == 64 and cfg.model_options()["target_batch_size"] == 64
    with pytest.raises(UserError, match="peers = 1: gpipe runs on >= 2 worker"):
        validate_config({"strategy": "gpipe", "peers": 1})


def test_each_model_table_is_a_run_config_table():
    from ddlscope.config import CONFIG_TABLES, RunConfig

    for table in distribution.config_tables():
        assert table in RunConfig.model_fields and table in CONFIG_TABLES


def _model_name_decisions(path: Path, names: set[str]) -> list[str]:
    """Comparisons (==, !=, in, not in) of anything with a model name or a literal collection of them."""
    found = []

    def literal_names(node) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value} & names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(literal_names(e) for e in node.elts)) if node.elts else set()
        return set()

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            hit = set().union(*(literal_names(n) for n in [node.left, *node.comparators]))
            if hit:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {sorted(hit)}")
        if isinstance(node, ast.Dict):  # name -> behaviour tables
            hit = set().union(*(literal_names(k) for k in node.keys if k is not None))
            if len(hit) > 1:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: table keyed by {sorted(hit)}")
    return found


def test_no_module_outside_a_models_own_files_decides_by_its_name():
    names = set(distribution.names())
    own = {PACKAGE / "distribution" / "__init__.py"}
    for m in distribution.all_models():
        own.add(PACKAGE / "distribution" / f"{m.name}.py")
        own.add(PACKAGE / "strategies" / f"{m.strategy.split(':')[0]}.py")
    own |= {PACKAGE / "distribution" / f"{p.stem}.py" for p in (PACKAGE / "distribution").glob("*.py")}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path not in own:
            offenders += _model_name_decisions(path, names)
    assert not offenders, "decisions by distribution-model name outside the model's files:\n" + "\n".join(offenders)


def test_models_command_lists_every_model_with_its_launcher():
    out = subprocess.run([sys.executable, "-m", "ddlscope.cli", "models"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for m in distribution.all_models():
        line = next(line for line in out.stdout.splitlines() if line.startswith(m.name + " "))
        assert m.summary in line
        assert f"launcher {m.launcher}" in out.stdout

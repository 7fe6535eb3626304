"""docs/config.md lists every field of a run config with its default, as the code has it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from ddlscope.config import DistributedConfig, RunConfigBase
from ddlscope.distribution.collaborative import CollaborativeConfig

PAGE = Path(__file__).resolve().parent.parent / "docs" / "config.md"
TABLES = {"run": RunConfigBase, "collaborative": CollaborativeConfig, "distributed": DistributedConfig}
NOT_IN_RUN = {"distributed", "network"}  # tables of their own, not fields of [run]
KEY = re.compile(r"^([a-z_]+)\s*=")


def documented_fields(text: str) -> dict[str, dict[str, tuple[bool, object]]]:
    """``{table: {field: (commented, value)}}`` from the first TOML block after "## Every field": a line
    ``field = value`` (commented False: the default) or ``# field = value`` (commented True: an example)."""
    block = text.split("## Every field", 1)[1].split("```toml\n", 1)[1].split("```\n", 1)[0]
    fields: dict[str, dict[str, tuple[bool, object]]] = {}
    table = None
    for line in block.splitlines():
        line = line.strip()
        if line.startswith("[") and not line.startswith("[["):
            table = line[1:line.index("]")]
            fields[table] = {}
            continue
        commented = line.startswith("#")
        body = line.lstrip("#").strip() if commented else line
        match = KEY.match(body)
        if not match:
            continue  # a comment only
        name = match.group(1)
        assert table is not None and name not in fields[table], f"{name} twice or outside a table"
        fields[table][name] = (commented, tomllib.loads(body)[name])
    return fields


def test_the_parser_reads_defaults_examples_and_comments():
    text = "## Every field\n\n```toml\n[run]\nbatch_size = 32  # per peer\n# name = \"x\"  # a label\n" \
           "#     # only a comment\n[distributed]\nbalance = \"layers\"\n```\n"
    assert documented_fields(text) == {"run": {"batch_size": (False, 32), "name": (True, "x")},
                                       "distributed": {"balance": (False, "layers")}}


@pytest.mark.parametrize("table", sorted(TABLES))
def test_every_field_is_documented_with_its_default(table):
    documented = documented_fields(PAGE.read_text())[table]
    model = TABLES[table]
    fields = {name: info for name, info in model.model_fields.items() if not (table == "run" and name in NOT_IN_RUN)}
    assert set(documented) == set(fields), (f"[{table}] in docs/config.md: missing {sorted(set(fields) - set(documented))}, "
                                            f"not in the code {sorted(set(documented) - set(fields))}")
    for name, (commented, value) in documented.items():
        default = fields[name].get_default(call_default_factory=True)
        if commented:  # an example: only for a field with nothing set by default
            assert default in (None, [], ""), f"[{table}] {name} is commented out, but its default is {default!r}"
        else:
            assert value == default, f"[{table}] {name} = {value!r} in docs/config.md; the code's default is {default!r}"

"""The Python API: the recorder on a user's own loop (plain and under torchrun), ``ddlscope.run`` with user
factories, and the examples that use them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import ddlscope
from ddlscope.errors import UserError
from ddlscope.store.db import ResultsStore

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "ddlscope" / "examples"
TESTS = Path(__file__).resolve().parent


def _data(n: int = 96, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=gen)
    x = torch.randn(n, 1, 6, 6, generator=gen) + y.view(-1, 1, 1, 1).float()
    return torch.utils.data.TensorDataset(x, y)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 4))


def _rows(db: Path, run_id: str) -> dict:
    with ResultsStore(db) as store:
        return {"run": dict(store.run(run_id)), "config": store.run_config(run_id),
                **{t: store.rows(t, run_id) for t in ("steps", "workers", "evals", "host_samples", "events")}}


# ------------------------------------------------------------------------------------ recorder
def test_recorder_explicit_phases_store_a_run_that_reports(tmp_path):
    db = tmp_path / "r.db"
    model, loader = _net(), torch.utils.data.DataLoader(_data(), batch_size=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ddlscope.record("explicit", db=db, model="mlp", dataset="blobs", warmup_steps=1,
                         host_sample_interval_s=0.05) as rec:
        for x, y in rec.batches(loader):
            with rec.step(len(x)) as st:
                with rec.phase("forward"):
                    loss = nn.functional.cross_entropy(model(x), y)
                with rec.phase("backward"):
                    optimizer.zero_grad()
                    loss.backward()
                with rec.phase("optimizer"):
                    optimizer.step()
                st.loss = loss
        with rec.evaluation() as ev:
            ev.record(0.75, 0.5, 96)
    rows = _rows(db, rec.run_id)
    assert rows["run"]["status"] == "completed" and rows["run"]["strategy"] == "single"
    assert rows["config"]["source"] == "recorder" and rows["config"]["batch_size"] == 16 and rows["config"]["peers"] == 1
    steps = rows["steps"]
    assert [s["step"] for s in steps] == list(range(6)) and [s["warmup"] for s in steps] == [1, 0, 0, 0, 0, 0]
    for s in steps:
        assert s["samples"] == 16 and s["loss"] > 0
        parts = [s[p] for p in ("data_load_s", "forward_s", "backward_s", "optimizer_s")]
        assert all(p is not None and p > 0 for p in parts)
        assert sum(parts) <= s["step_s"] + 1e-6  # the parts lie inside the step's wall time
        assert s["comm_s"] == 0.0 and s["comm_wait_s"] == 0.0  # one process: nothing to communicate
    worker = rows["workers"][0]
    assert worker["status"] == "completed" and worker["train_end_time"] >= worker["train_start_time"]
    assert [(e["step"], e["accuracy"]) for e in rows["evals"]] == [(5, 0.75)]
    assert len(rows["host_samples"]) >= 2

    from ddlscope.experiments.results import measure_run

    with ResultsStore(db) as store:
        measured = measure_run(store, rec.run_id)
    assert measured is not None and measured.parts_s["forward_s"] > 0
    report = ddlscope.report(rec.run_id, db=db, out=tmp_path / "report", print_table=False)
    summary = json.loads((report.parent / "summary.json").read_text())
    text = json.dumps(summary)
    assert rec.run_id in text and "bound" in text  # the bottleneck verdict of the recorded run


def test_recorder_watch_times_steps_without_code_in_the_loop(tmp_path):
    db = tmp_path / "r.db"
    model, data = _net(), _data(64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = ddlscope.record("auto", db=db, warmup_steps=0)
    rec.watch(model, optimizer)
    batches = list(torch.utils.data.DataLoader(data, batch_size=8))
    for i in range(0, len(batches), 2):  # gradient accumulation: two micro-batches per optimizer step
        for x, y in batches[i:i + 2]:
            (nn.functional.cross_entropy(model(x), y) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        rec.note(loss=1.5)
        with torch.no_grad():
            model(batches[0][0])  # an evaluation forward: not a step
    rec.finish()
    rows = _rows(db, rec.run_id)
    steps = rows["steps"]
    assert rows["run"]["status"] == "completed" and len(steps) == 4
    for s in steps:
        assert s["samples"] == 16 and s["optimizer_stepped"] == 1 and s["loss"] == 1.5
        assert all(s[p] > 0 for p in ("forward_s", "backward_s", "optimizer_s", "data_load_s"))
        assert s["forward_s"] + s["backward_s"] + s["optimizer_s"] + s["data_load_s"] <= s["step_s"] + 1e-6
    assert rows["config"]["batch_size"] == 16


def test_recorder_stores_failure_and_interruption(tmp_path):
    db = tmp_path / "r.db"
    with pytest.raises(ValueError, match="boom"):
        with ddlscope.record("fails", db=db, batch_size=4) as rec:
            with rec.step():
                pass
            raise ValueError("boom")
    rows = _rows(db, rec.run_id)
    assert rows["run"]["status"] == "failed" and rows["run"]["reason"].startswith("ValueError: boom")
    assert rows["workers"][0]["status"] == "failed" and len(rows["steps"]) == 1
    with pytest.raises(KeyboardInterrupt):
        with ddlscope.record("stopped", db=db, batch_size=4) as rec2:
            raise KeyboardInterrupt
    assert _rows(db, rec2.run_id)["run"]["status"] == "interrupted"


def test_recorder_finishes_at_exit_with_the_uncaught_error(tmp_path):
    db = tmp_path / "r.db"
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import ddlscope
        rec = ddlscope.record("at-exit", db={str(db)!r}, batch_size=2)
        with rec.step():
            pass
        print(rec.run_id, flush=True)
        raise RuntimeError("lost the GPU")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "lost the GPU" in out.stderr
    rows = _rows(db, out.stdout.strip())
    assert rows["run"]["status"] == "failed" and "RuntimeError: lost the GPU" in rows["run"]["reason"]


@pytest.mark.parametrize("call, message", [
    (lambda rec: rec.phase("forward").__enter__(), "outside a step"),
    (lambda rec: rec.step(1).__enter__() and rec.phase("fwd").__enter__(), "allowed: data_load, forward"),
    (lambda rec: rec.log_step(4, step_s=-1.0), "seconds >= 0"),
    (lambda rec: rec.watch(object()), "allowed: a torch.nn.Module"),
])
def test_recorder_misuse_is_named(tmp_path, call, message):
    rec = ddlscope.record("misuse", db=tmp_path / "r.db")
    with pytest.raises(UserError, match=message):
        call(rec)
    rec.finish("failed", "test")


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="horovod"), "allowed: single"), (dict(batch_size=0), "positive integer"),
    (dict(warmup_steps=-1), ">= 0"), (dict(profile_steps=(3, 1)), "0 <= a <= b"),
])
def test_recorder_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(UserError, match=message):
        ddlscope.Recorder("bad", db=tmp_path / "r.db", **kwargs)


# ------------------------------------------------------------------------------------ ddlscope.run
def test_validate_config_takes_importable_callables_and_names_the_others():
    from ddlscope.config import validate_config

    sys.path.insert(0, str(TESTS))
    try:
        import api_factories
    finally:
        sys.path.remove(str(TESTS))
    cfg = validate_config(dict(model=api_factories.SmallCNN, dataset="digits", loss=api_factories.smoothed_cross_entropy,
                               optimizer=torch.optim.RMSprop))
    assert (cfg.model, cfg.loss) == ("api_factories:SmallCNN", "api_factories:smoothed_cross_entropy")
    assert cfg.optimizer == f"{torch.optim.RMSprop.__module__}:RMSprop"
    assert validate_config(dict(model="tiny_cnn", dataset="digits")).loss == "cross_entropy"  # string configs as before

    def make(num_classes, in_channels):  # a closure of this test
        return nn.Linear(in_channels, num_classes)

    for value, why in ((_net(), "is a model instance"), (make, "closure"), (lambda **k: None, "lambda")):
        with pytest.raises(UserError, match=why) as err:
            validate_config(dict(model=value, dataset="digits"))
        assert "allowed: a function or class defined at the top level of an importable module" in str(err.value)
    with pytest.raises(UserError, match="names the script being run"):
        validate_config(dict(model="__main__:make", dataset="digits"))


def test_run_trains_user_factories_and_raises_when_the_run_fails(env_data, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("DDLSCOPE_SHARE_CORES", "1")  # the cores may be leased by a run of another test
    import api_factories

    db = tmp_path / "r.db"
    record = ddlscope.run(api_factories.SmallCNN, api_factories.Blobs, loss=api_factories.smoothed_cross_entropy,
                          optimizer=torch.optim.Adam, db=db, batch_size=32, sample_budget=128, loader_workers=0,
                          warmup_steps=1, final_eval=True, learning_rate=0.01)
    assert record["status"] == "completed"
    assert record["config"]["dataset"] == "api_factories:Blobs" and record["config"]["loss"].endswith("smoothed_cross_entropy")
    rows = _rows(db, record["run_id"])
    assert len(rows["steps"]) == 4 and rows["evals"][-1]["samples"] == 128  # the factory's test split
    with pytest.raises(ddlscope.RunFailed, match="broke at forward 3") as failed:
        ddlscope.run(api_factories.FailsInWorker, "digits", db=db, batch_size=8, sample_budget=64, loader_workers=0)
    assert failed.value.status == "failed" and failed.value.record["workers"][0]["status"] == "failed"


# ------------------------------------------------------------------------------------ examples
def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_own_loop_imagefolder_example(env_data, tmp_path, capsys):
    example = _load_example("own_loop_imagefolder")
    db = tmp_path / "r.db"
    report = example.main(["--data", str(env_data / "digits"), "--db", str(db), "--epochs", "1", "--max-steps", "5",
                           "--batch-size", "16"])
    assert report.is_file()
    with ResultsStore(db) as store:
        (run,) = store.runs()
        assert run["status"] == "completed" and len(store.rows("steps", run["run_id"])) == 5
        assert store.rows("evals", run["run_id"])[0]["samples"] == 359  # the digits' test split
    assert "report.html" in capsys.readouterr().out


def test_torchrun_example_instrumented_in_five_lines(tmp_path):
    source = (EXAMPLES / "torchrun_instrumented.py").read_text()
    code = source.split('"""', 2)[2]  # after the module docstring
    added = [line for line in code.splitlines() if line.rstrip().endswith("# +ddlscope")]
    assert 1 <= len(added) <= 5
    uses = re.compile(r"import ddlscope|\bddlscope\.\w+\(|\brec\b")  # every line that touches ddlscope is marked
    assert all(line.rstrip().endswith("# +ddlscope") for line in code.splitlines() if uses.search(line))
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    db = tmp_path / "r.db"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(EXAMPLES / "torchrun_instrumented.py"),
                          "--db", str(db), "--steps", "6"], capture_output=True, text=True, timeout=180, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    with ResultsStore(db) as store:
        (run,) = store.runs()
        rows = _rows(db, run["run_id"])
    assert run["status"] == "completed" and run["strategy"] == "ddp" and rows["config"]["peers"] == 2
    assert [w["status"] for w in rows["workers"]] == ["completed", "completed"]
    assert [json.loads(e["detail_json"])["hooked"] for e in rows["events"] if e["kind"] == "comm_hook"] == [True, True]
    example = _load_example("torchrun_instrumented")
    grad_bytes = 4 * sum(p.numel() for p in example.Net().parameters())
    for worker in (0, 1):
        steps = [s for s in rows["steps"] if s["worker_index"] == worker]
        assert len(steps) == 6
        assert all(s["comm_bytes"] == grad_bytes and s["comm_s"] > 0 and s["comm_wait_s"] is not None for s in steps)

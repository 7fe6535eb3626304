"""Bad input, fuzzed: every case ends with exit status 2 and one ``error:`` line on stderr that
names the field or file, no traceback, and nothing written — no run row, no database, no file or
folder next to the inputs (issue 18, item 4).

Each case runs the CLI's entry point (:func:`ddlscope.cli.main`) in this process with its own
working folder holding the case's input files; creating a run row fails the test at once, so a
case that slipped through validation cannot start a run. Two cases also run ``python -m ddlscope``
as a user does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddlscope import cli
from ddlscope.store.db import ResultsStore

BINARY = bytes(range(256)) * 4  # not UTF-8 from byte 128 on
LATIN_1 = '[run]\nname = "caf\xe9"\n'.encode("latin-1")
NOT_SQLITE = "this is no database\n" * 50
TINY = ["--set", "model='tiny_cnn'"]
COLLAB2 = ["--set", "strategy='collaborative'", "--set", "peers=2", "--set", "vcpus_per_peer=1", *TINY]
GPIPE2 = ["--set", "strategy='gpipe'", "--set", "peers=2", "--set", "vcpus_per_peer=1", *TINY]
PEER = ["peer", "--strategy", "collaborative", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1"]
FOLDER = None  # as a file's content: make a folder instead

CASES: list = []


def case(case_id: str, args: list[str], must: str, files: dict | None = None, marks=()):
    """One fuzz case: CLI arguments, a text the error line must contain, and input files to create
    (relative path -> text, bytes, or FOLDER)."""
    CASES.append(pytest.param(args, must, files or {}, id=case_id, marks=marks))


# ---------------------------------------------------------------- input files of every kind
CLUSTER_ARGS = ["recommend", "--model", "tiny_cnn", "--dataset", "mnist", "--cache-dir", "prof", "--cluster"]
FILE_KINDS = {  # kind -> (arguments before/after the path, what an empty file is told)
    "config": (["run"], [], "sets nothing"),
    "cluster": (CLUSTER_ARGS, [], "no [cluster] table"),
    "grid": (["sweep"], ["--dry-run"], "sets nothing"),
    "suite": (["suite"], ["--dry-run"], "expected exactly one [suite] table"),
    "validation": (["validate"], ["--predict-only"], "expected exactly one [validation] table"),
    "peer-config": ([*PEER, "--index", "0", "--peers", "2", "--config"], [], "sets nothing"),
}
for kind, (before, after, empty_says) in FILE_KINDS.items():
    run_with = lambda path: [*before, path, *after]  # noqa: E731
    case(f"{kind}-missing", run_with("nope.toml"), "nope.toml")
    case(f"{kind}-folder", run_with("in.toml"), "in.toml", {"in.toml": FOLDER})
    case(f"{kind}-binary", run_with("in.toml"), "in.toml", {"in.toml": BINARY})
    case(f"{kind}-latin-1", run_with("in.toml"), "in.toml", {"in.toml": LATIN_1})
    case(f"{kind}-invalid-toml", run_with("in.toml"), "is not valid TOML", {"in.toml": "[x\n"})
    case(f"{kind}-empty", run_with("in.toml"), empty_says, {"in.toml": ""})
    case(f"{kind}-comments-only", run_with("in.toml"), empty_says, {"in.toml": "# nothing here\n"})
    case(f"{kind}-under-a-file", run_with("f/in.toml"), "f/in.toml", {"f": "a file"})

# ---------------------------------------------------------------- the shape of a run config file
for i, (text, must) in enumerate([("run = 5\n", "run = 5 is not a table"), ("run = [1, 2]\n", "run = [1, 2] is not a table"),
                   ("run = 'x'\n", "is not a table"), ("run = true\n", "is not a table"),
                   ("distributed = 5\n[run]\nmodel = 'tiny_cnn'\n", "distributed"),
                   ("collaborative = 5\n[run]\nmodel = 'tiny_cnn'\n", "collaborative"),
                   ("[runn]\nmodel = 'tiny_cnn'\n", "unknown table(s) ['runn']; allowed: [run]"),
                   ("[run]\nbatchsize = 3\n", "batchsize: unknown field; allowed: name, strategy, model"),
                   ("[run]\nmodel = 'tiny_cnn'\n[distributed]\nbogus = 1\n",
                    "distributed.bogus: unknown field; allowed: backend"),
                   ("[run]\nmodel = 'tiny_cnn'\n[collaborative]\nbogus = 1\n",
                    "collaborative.bogus: unknown field; allowed: target_batch_size"),
                   ("[run]\nname = 5\n", "name"), ("[run]\nlearning_rate = inf\n", "learning_rate: inf"),
                   ("[run]\nlearning_rate = nan\n", "learning_rate: nan"),
                   ("[run]\nmodel = 'tiny_cnn'\ndistributed = {stage_bounds = [0, inf]}\n", "stage_bounds")]):
    case(f"config-{i}-{text.splitlines()[0][:30]}", ["run", "in.toml"], must, {"in.toml": text})

# ---------------------------------------------------------------- numbers: finite, in range, of the right type
for field in ("learning_rate", "momentum", "weight_decay", "time_limit_s", "host_sample_interval_s",
              "target_accuracy", "distributed.timeout_s", "distributed.bucket_cap_mb",
              "collaborative.matchmaking_time_s", "collaborative.averaging_timeout_s"):
    case(f"inf-{field}", ["run", *TINY, "--set", f"{field}=inf"], f"{field}: inf is not a finite number")
for field in ("learning_rate", "time_limit_s", "distributed.timeout_s", "momentum"):
    case(f"nan-{field}", ["run", *TINY, "--set", f"{field}=nan"], f"{field}: nan is not a finite number")
for field in ("learning_rate", "weight_decay"):
    case(f"-inf-{field}", ["run", *TINY, "--set", f"{field}=-inf"], f"{field}: -inf is not a finite number")
for field, value in [("batch_size", "0"), ("batch_size", "-1"), ("batch_size", "1000000000"), ("seed", "-1"),
                     ("seed", "1099511627776"), ("seed", "9223372036854775807"), ("sample_budget", "0"),
                     ("sample_budget", "1000000000000000"), ("learning_rate", "0"), ("learning_rate", "100"),
                     ("momentum", "1"), ("weight_decay", "5"), ("peers", "0"), ("peers", "1000"),
                     ("loader_workers", "100"), ("gradient_accumulation_steps", "0"), ("eval_every_steps", "0"),
                     ("time_limit_s", "0"), ("time_limit_s", "1e12"), ("host_sample_interval_s", "0"),
                     ("target_accuracy", "1.5"), ("warmup_steps", "-1"), ("vcpus_per_peer", "0"),
                     ("distributed.rendezvous_port", "70000"), ("distributed.microbatches", "0"),
                     ("collaborative.request_timeout_s", "0"), ("collaborative.request_timeout_s", "-1")]:
    case(f"range-{field}={value}", ["run", *TINY, "--set", f"{field}={value}"], field)
for field, value in [("batch_size", "abc"), ("batch_size", "true"), ("batch_size", "3.5"), ("batch_size", "[1]"),
                     ("learning_rate", "'fast'"), ("learning_rate", "false"), ("peers", "true"), ("strategy", "5"),
                     ("device", "'tpu'"), ("optimizer", "'lbfgs'"), ("data_root", "5"), ("distributed", "5"),
                     ("distributed.backend", "'mpi'"), ("vcpus_per_peer", "true"), ("time_limit_s", "false")]:
    case(f"type-{field}={value}", ["run", *TINY, "--set", f"{field}={value}"], field)

# ---------------------------------------------------------------- --set syntax
for sets, must in [(["batch_size"], "expected key=value"), (["=3"], "is not a field name"),
                   (["distributed..x=1"], "is not a field name"), (["batch_size.=1"], "is not a field name"),
                   (["batch_size=3", "batch_size.x=1"], "cannot be a table too"),
                   (["batch_size.x=1", "batch_size=3"], "cannot be a value too"),
                   (["distributed.backend='gloo'", "distributed=5"], "cannot be a value too")]:
    case(f"set-{'|'.join(sets)}", ["run", *[a for s in sets for a in ("--set", s)]], must)

# ---------------------------------------------------------------- names, combinations, addresses
for sets, must in [(["strategy='ring'"], "strategy"), (["model='resnet9000'"], "resnet9000"),
                   (["dataset='no-such-dataset'"], "no-such-dataset"), (["dataset='./nope'"], "nope"),
                   (["strategy='single'", "peers=2"], "peers = 2"), (["sample_budget=8", "batch_size=16"], "sample_budget"),
                   (["sample_budget=nan"], "sample_budget"),
                   (["strategy='collaborative'", "peers=2", "collaborative.target_batch_size=8"], "target_batch_size"),
                   (["strategy='collaborative'", "peers=2", "vcpus_per_peer=64"], "vcpus_per_peer"),
                   (["model='moe_lm'"], "moe_lm"),
                   (["strategy='gpipe'", "peers=2", "distributed.microbatches=64"], "microbatches"),
                   (["strategy='gpipe'", "peers=2", "vcpus_per_peer=1", "distributed.stage_bounds=[0, 3, 2]"],
                    "stage_bounds"),
                   (["strategy='collaborative'", "peers=2", "vcpus_per_peer=1",
                     "collaborative.listen_host='not a host'"], "collaborative.listen_host = 'not a host'"),
                   (["strategy='collaborative'", "peers=2", "vcpus_per_peer=1", "collaborative.listen_host='::1'"],
                    "collaborative.listen_host"),
                   (["strategy='dmoe'", "model='moe_cnn'", "dmoe.listen_host='localhost:99'"], "dmoe.listen_host"),
                   (["strategy='collaborative'", "peers=2", "vcpus_per_peer=1",
                     "collaborative.initial_peers=['garbage']"], "collaborative.initial_peers: 'garbage'")]:
    case(f"names-{'|'.join(sets)}", ["run", *TINY, *[a for s in sets for a in ("--set", s)]], must)
case("stage-bounds-beyond-layers", ["run", *GPIPE2, "--set", "distributed.stage_bounds=[0, 3, 1000]"], "stage_bounds")
case("stage-bounds-count", ["run", *GPIPE2, "--set", "distributed.stage_bounds=[0, 1, 2, 3]"], "stage_bounds")

# ---------------------------------------------------------------- what only the machine, the data or the model can tell
FACTORIES = {
    "two_classes": "return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(2))",
    "wrong_input": "return torch.nn.Linear(3, num_classes)",
    "raises": "raise ValueError('no such width')",
    "not_a_module": "return 42",
    "a_tuple_out": "return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(num_classes), Twice())",
    "flat_out": "return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(num_classes), torch.nn.Flatten(0))",
}
FACTORY_FILE = "import torch\n\nclass Twice(torch.nn.Module):\n    def forward(self, x):\n        return x, x\n\n" + "".join(
    f"def {name}(num_classes, in_channels):\n    {body}\n\n" for name, body in FACTORIES.items())
FACTORY_MUST = {"two_classes": "predicts 2 classes, but dataset 'digits' has 10", "wrong_input": "first batch",
                "raises": "ValueError: no such width", "not_a_module": "not a torch.nn.Module",
                "a_tuple_out": "returns tuple", "flat_out": "returns (20,)"}
for i, name in enumerate(FACTORIES):
    module = f"user_factories_{i}"  # a module name of its own per case: imported modules stay cached
    case(f"factory-{name}", ["run", "--set", f"model='{module}:{name}'"], FACTORY_MUST[name],
         {f"{module}.py": FACTORY_FILE})
case("factory-missing-module", ["run", "--set", "model='nosuchmodule_xyz:f'"], "nosuchmodule_xyz")
case("factory-not-callable", ["run", "--set", "model='os:sep'"], "no callable 'sep'")
case("factory-malformed", ["run", "--set", "model='a:b:c'"], "a:b:c")
case("batch-larger-than-split", ["run", *TINY, "--set", "batch_size=3000", "--set", "sample_budget=3000"],
     "batch_size = 3000 is larger than the training split")
case("data-root-is-a-file", ["run", *TINY, "--set", "data_root='f'"], "data_root = 'f' is a file", {"f": "x"})
case("data-root-without-the-dataset", ["run", *TINY, "--set", "data_root='empty'", "--set", "dataset='mnist'"],
     "dataset 'mnist' not found", {"empty": FOLDER})
case("dataset-path-is-a-file", ["run", *TINY, "--set", "dataset='d.txt'"], "d.txt", {"d.txt": "x"})
case("dataset-empty-folder", ["run", *TINY, "--set", "dataset='d'"], "no dataset found", {"d": FOLDER})
case("dataset-corrupt-idx", ["run", *TINY, "--set", "dataset='d'"], "d/",
     {"d/train-images-idx3-ubyte": b"\x00\x00\x08\x03garbage", "d/train-labels-idx1-ubyte": b"\x00\x00\x08\x01"})
case("cuda-without-cuda", ["run", *TINY, "--set", "device='cuda'"], "single on device cuda needs CUDA, but",
     marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA"))

# ---------------------------------------------------------------- options of the commands
for i, (args, must) in enumerate([
    (["run", *COLLAB2, "--local-peers", "3"], "--local-peers 3: allowed: 1..2"),
    (["run", *COLLAB2, "--local-peers", "0"], "--local-peers 0"), (["run", *COLLAB2, "--local-peers", "-1"], "-1"),
    (["run", *TINY, "--local-peers", "1"], "single starts all its workers itself"),
    (["run", *TINY, "--nnodes", "2"], "--rdzv-endpoint"), (["run", *TINY, "--nnodes", "0"], "--nnodes"),
    (["run", *TINY, "--local-addr", "10.9.9.9"], "--local-addr 10.9.9.9 is for a cluster"),
    (["run", *GPIPE2, "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29557", "--run-id", "x", "--local-addr", "10.9.9.9"],
     "--local-addr 10.9.9.9 is not an address of this host; allowed: one of"),
    (["run", *TINY, "--bogus"], "No such option: --bogus"), (["run", *TINY, "--local-peers", "x"], "--local-peers"),
    (["run"], "give a run config file or --set fields"), (["nosuchcommand"], "nosuchcommand"),
    (["sweep"], "give either a grid file or --preset"), (["sweep", "g.toml", "--preset", "local"], "give either"),
    (["sweep", "--preset", "nope", "--dry-run"], "unknown preset 'nope'"),
    (["sweep", "--preset", "local", "--max-cells", "0"], "--max-cells"),
    (["sweep", "--preset", "local", "--max-cells", "1000000000"], "--max-cells"),
    (["runs", "--status", "bogus"], "--status 'bogus'"), (["rm", "--yes"], "give run id(s) or --group"),
    (["rm", "abc", "--group", "g"], "not both"), (["matchmaking"], "give run id(s) or --group"),
    (["suite", "nope-preset", "--dry-run"], "nope-preset"),
    (["validate", "nope-preset", "--predict-only"], "nope-preset"),
    (["datapipe", "digits", "--loader-workers", "a"], "workers"),
    (["profile", "--model", "tiny_cnn", "--dataset", "mnist", "--batch-size", "8", "--loader-workers", "x"],
     "--loader-workers"),
    (["calibrate", "--timeout-s", "0"], "--timeout-s"), (["calibrate", "--out", "d"], "--out d is a folder"),
    (["calibrate", "--hivemind", "--swarm-network", "nope"], "swarm network 'nope'; allowed: a zoo network"),
    (["calibrate", "--hivemind", "--swarm-dataset", "svhn"], "swarm dataset 'svhn'; allowed: a dataset shape"),
    (["calibrate", "--hivemind", "--swarm-batch-sizes", "8,x"], "--swarm-batch-sizes '8,x'; allowed: whole numbers"),
    (["calibrate", "--hivemind", "--swarm-batch-sizes", "8,0"], "swarm batch sizes [8, 0]; allowed"),
    ([*PEER, "--index", "5", "--peers", "2", *TINY], "--index 5"),
    ([*PEER, "--index", "0", "--peers", "2", "--cores", "a,b", *TINY], "--cores"),
    (["peer", "--strategy", "collaborative", "--run-id", "r", "--index", "0", "--peers", "2"], "--initial-peers"),
    (["serve-experts", "--index", "9", "--set", "model='moe_cnn'"], "--index 9"),
    (["quickstart", "--peers", "100"], "--peers 100"), (["quickstart", "--model", "nope"], "nope"),
    (["quickstart", "--batch-size", "0"], "batch_size"), (["quickstart", "--sample-budget", "-5"], "sample_budget"),
]):
    case(f"options-{i}-{' '.join(args)[:60]}", args, must, {"d": FOLDER})

# ---------------------------------------------------------------- --db
for command in (["run", *TINY], ["sweep", "--preset", "local"], ["suite", "local"], ["quickstart"]):
    name = command[0]
    case(f"db-{name}-not-sqlite", [*command, "--db", "x.db"], "--db x.db is not a ddlscope results database",
         {"x.db": NOT_SQLITE})
    case(f"db-{name}-folder", [*command, "--db", "d"], "--db d is a folder", {"d": FOLDER})
    case(f"db-{name}-under-a-file", [*command, "--db", "f/x.db"], "is a file, not a folder", {"f": "x"})
case("db-run-read-only-folder", ["run", *TINY, "--db", "ro/x.db"], "cannot be written", {"ro": FOLDER},
     marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only folders"))
for command in (["runs"], ["report"], ["rm", "abc", "--yes"], ["sweep-report", "s"], ["matchmaking", "--group", "g"],
                ["export", "--group", "g", "--to", "csv"], ["suite", "local", "--report-only"]):
    name = command[0] + ("-report-only" if "--report-only" in command else "")
    case(f"db-{name}-missing", [*command, "--db", "typo/x.db"], "no results database at typo/x.db")
    case(f"db-{name}-not-sqlite", [*command, "--db", "x.db"], "not a ddlscope results database", {"x.db": NOT_SQLITE})
    case(f"db-{name}-under-a-file", [*command, "--db", "f/x.db"], "f/x.db", {"f": "x"})
    case(f"db-{name}-folder", [*command, "--db", "d"], "d is a folder", {"d": FOLDER})

# ---------------------------------------------------------------- cluster descriptions and the recommender's options
CLUSTER = ("[cluster]\nnodes = {nodes}\ndevices_per_node = {dpn}\n[cluster.device]\nkind = '{kind}'{memory}\n"
           "[cluster.intra_node]\nbandwidth_gb_per_s = {bw}\nlatency_s = {lat}\n{extra}")


def cluster(nodes=1, dpn=2, kind="a100-40gb", memory="", bw="10.0", lat="1e-5", extra="") -> dict:
    return {"c.toml": CLUSTER.format(nodes=nodes, dpn=dpn, kind=kind, memory=memory, bw=bw, lat=lat, extra=extra)}


INTER = "[cluster.inter_node]\nbandwidth_gb_per_s = 1.0\nlatency_s = 0.0\n"
for case_id, files, must in [
    ("devices-per-node-1e9", cluster(dpn=1000000000), "cluster.devices_per_node"),
    ("nodes-1e9", cluster(nodes=1000000000, extra=INTER), "cluster.nodes"),
    ("latency-inf", cluster(lat="inf"), "cluster.intra_node.latency_s: Input should be a finite number"),
    ("latency-nan", cluster(lat="nan"), "cluster.intra_node.latency_s"),
    ("latency-negative", cluster(lat="-1.0"), "cluster.intra_node.latency_s"),
    ("latency-hour", cluster(lat="3600.0"), "cluster.intra_node.latency_s"),
    ("bandwidth-inf", cluster(bw="inf"), "cluster.intra_node.bandwidth_gb_per_s"),
    ("bandwidth-nan", cluster(bw="nan"), "cluster.intra_node.bandwidth_gb_per_s"),
    ("bandwidth-zero", cluster(bw="0.0"), "cluster.intra_node.bandwidth_gb_per_s"),
    ("memory-inf", cluster(memory="\nmemory_gib = inf"), "cluster.device.memory_gib"),
    ("unknown-kind", cluster(kind="a100"), "unknown device kind 'a100'"),
    ("unknown-field", cluster(extra="bogus = 1\n"), "cluster.intra_node.bogus: unknown field; allowed"),
    ("two-nodes-no-inter-node", cluster(nodes=2), "cluster.inter_node"),
    ("overlap-2", {"c.toml": cluster()["c.toml"].replace("[cluster.device]", "comm_overlap = 2.0\n[cluster.device]")},
     "cluster.comm_overlap"),
    ("peer-share-inf", cluster(extra="[[cluster.peers]]\ncompute_share = inf\nbandwidth_gb_per_s = 1.0\n"),
     "cluster.peers[0].compute_share"),
    ("cluster-not-a-table", {"c.toml": "cluster = 5\n"}, "cluster must be a table"),
]:
    case(f"cluster-{case_id}", [*CLUSTER_ARGS, "c.toml"], must, files)
for options, must in [(["--workers", "1000000000"], "workers 1000000000; allowed"),
                      (["--batch-size", "1000000000000"], "batch size 1000000000000; allowed"),
                      (["--strategies", "nope"], "unknown distribution model 'nope'"),
                      (["--microbatches", "1000000000000000000"], "microbatches"),
                      (["--target-batch-size", "1000000000000"], "target batch size"),
                      (["--batch-size", "0"], "--batch-size"), (["--dataset", "nope"], "unknown dataset 'nope'")]:
    case(f"recommend-{'|'.join(options)}", [*CLUSTER_ARGS, "c.toml", *options], must, cluster())

# ---------------------------------------------------------------- sweep grids
for case_id, text, must in [
    ("repeats-1e8", "[base]\nmodel = 'tiny_cnn'\n[axes]\nrepeats = 100000000\n", "100000000 cells"),
    ("repeats-1e8-x2", "[base]\nmodel = 'tiny_cnn'\n[axes]\nrepeats = 100000000\nbatch_size = [8, 16]\n",
     "200000000 cells"),
    ("repeats-negative", "[axes]\nrepeats = -1\n", "repeats = -1"),
    ("repeats-text", "[axes]\nrepeats = 'x'\n", "repeats = 'x'"),
    ("repeats-index-huge", "[axes]\nrepeats = [1000000000000]\n", "repeats = [1000000000000]"),
    ("repeats-bool", "[axes]\nrepeats = [true]\n", "repeats = [True]"),
    ("axis-not-a-list", "[axes]\nbatch_size = 8\n", "axis 'batch_size' = 8 is not a list"),
    ("unknown-axis", "[axes]\nbogus = [1]\n", "unknown axis/axes ['bogus']; allowed"),
    ("empty-axis", "[axes]\nbatch_size = []\n", "zero cells"),
    ("product-1e10", "[axes]\n" + "".join(f"{k} = {list(range(1, 101))}\n" for k in
                                          ("batch_size", "seed", "warmup_steps", "eval_every_steps", "loader_workers")),
     "10000000000 cells"),
    ("axis-inf", "[base]\nmodel = 'tiny_cnn'\n[axes]\nlearning_rate = [inf]\n", "learning_rate: inf"),
    ("base-seed-huge", "[base]\nseed = 9223372036854775807\n[axes]\nrepeats = 2\n", "seed"),
    ("base-not-a-table", "base = 5\n", "[base] must be a table"),
    ("axes-not-a-table", "axes = 5\n", "[axes] must be a table"),
    ("unknown-key", "bogus = 1\n[axes]\nbatch_size = [8]\n", "unknown top-level key(s) ['bogus']"),
    ("total-vcpus-without-peers", "[axes]\ntotal_vcpus = 2\nbatch_size = [8]\n", "total_vcpus needs a peers axis"),
    ("peers-zero", "[axes]\npeers = [0]\n", "peers value 0"),
]:
    case(f"grid-{case_id}", ["sweep", "g.toml", "--dry-run"], must, {"g.toml": text})

# ---------------------------------------------------------------- suites and validation grids
for case_id, text, must in [
    ("not-a-table", "suite = 5\n", "got suite = 5"), ("workers-1", "[suite]\nworkers = [1]\n", "workers"),
    ("workers-1e5", "[suite]\nworkers = [100000]\n", "<= 256"), ("datasets", "[suite]\ndatasets = ['nope']\n", "nope"),
    ("networks", "[suite]\nnetworks = ['nope']\n", "nope"), ("measured-0", "[suite]\nmeasured_batches = 0\n",
                                                                "measured_batches"),
    ("unknown-field", "[suite]\nbogus = 1\n", "bogus: unknown field; allowed: name, datasets"),
    ("preset", "[suite]\npreset = 'nope'\n", "suite.preset = 'nope'"),
    ("measured-inf", "[suite]\nmeasured_batches = inf\n", "suite.measured_batches: inf"),
]:
    case(f"suite-{case_id}", ["suite", "s.toml", "--dry-run"], must, {"s.toml": text})
for case_id, text, must in [
    ("not-a-table", "validation = 5\n", "got validation = 5"),
    ("workers-1", "[validation]\ndatasets = ['mnist']\nnetworks = ['tiny_cnn']\nworkers = 1\n", "workers"),
    ("unknown-field", "[validation]\ndatasets = ['mnist']\nnetworks = ['tiny_cnn']\nbogus = 1\n",
     "bogus: unknown field; allowed: name, datasets"),
    ("batch-inf", "[validation]\ndatasets = ['mnist']\nnetworks = ['tiny_cnn']\nbatch_size = inf\n", "batch_size"),
]:
    case(f"validation-{case_id}", ["validate", "v.toml", "--predict-only"], must, {"v.toml": text})


def _tree(folder: Path) -> set[str]:
    return {str(p) for p in folder.rglob("*")}


@pytest.fixture
def workdir(tmp_path, data_root, monkeypatch):
    """A working folder for one case; reading data from the test data root, never creating a run."""
    folder = tmp_path / "work"
    folder.mkdir()
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setenv("DDLSCOPE_DATA", str(data_root))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "matplotlib"))  # its font cache is not the command's

    def no_run_row(*args, **kwargs):
        raise AssertionError("a run row was created: the input got past every check")

    monkeypatch.setattr(ResultsStore, "create_run", no_run_row)
    before = set(sys.modules)
    yield folder
    for name in set(sys.modules) - before:  # the cases' own factory modules
        if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(tmp_path)):
            del sys.modules[name]


def _alarm(signum, frame):
    raise TimeoutError("the command did not end within 60 s (a hang on bad input)")


@pytest.mark.parametrize("args, must, files", CASES)
def test_bad_input_gives_one_error_line_and_writes_nothing(workdir, capsys, monkeypatch, args, must, files):
    for rel, content in files.items():
        path = workdir / rel
        if content is FOLDER:
            path.mkdir(parents=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    if "ro" in files:
        (workdir / "ro").chmod(0o500)
    before = _tree(workdir) | _tree(workdir.parent / "home")
    monkeypatch.setattr(sys, "argv", ["ddlscope", *args])
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exit_info.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert must in lines[0], lines[0]
    after = _tree(workdir) | _tree(workdir.parent / "home")
    assert after == before, "the command wrote a file or folder (working folder or home)"


def test_the_cases_cover_the_issue():
    assert len(CASES) >= 150
    assert len({c.id for c in CASES}) == len(CASES), "case ids are unique"


@pytest.mark.parametrize("args, files", [
    (["run", "in.toml"], {"in.toml": BINARY}),
    (["run", "--set", "model='tiny_cnn'", "--bogus"], {}),
])
def test_the_console_command_prints_one_line_too(tmp_path, args, files):
    for rel, content in files.items():
        (tmp_path / rel).write_bytes(content)
    result = subprocess.run([sys.executable, "-m", "ddlscope", *args], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[1])})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)

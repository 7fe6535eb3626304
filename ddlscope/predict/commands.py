"""CLI commands of the predictor: ``profile``, ``calibrate``, ``recommend``, ``validate``.

:func:`register` adds them to the main ``ddlscope`` app (kept here so that the predictor's
commands read together). User errors raise :class:`~ddlscope.errors.UserError`. They follow the
command line's conventions (:mod:`ddlscope.cli`): ``--json`` prints one strict JSON document on stdout
and everything else on stderr; tables take the terminal's width.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from ddlscope import distribution
from ddlscope.distribution.collaborative import DEFAULT_MATCHMAKING_TIME_S
from ddlscope.errors import UserError


def parse_worker_counts(text: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> ``(0, 1, 2)``; an empty string -> ``()``.

    Raises:
        UserError: an entry that is not an integer >= 0.
    """
    counts = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit():
            raise UserError(f"--loader-workers {text!r}: allowed: comma-separated integers >= 0, e.g. 0,1,2")
        counts.append(int(part))
    return tuple(counts)


def print_profile(profile, path: Path | None = None, console=None) -> None:
    """Print a :class:`~ddlscope.modeling.profile.WorkloadProfile` as rich tables.

    Per layer at the requested (largest) batch size: forward/backward ms, parameter MB,
    output / saved KB per sample, forward MFLOP per sample; then the whole step per batch size
    (extrapolated ones marked *), one line on the batch sizes that did not fit the device
    (:meth:`~ddlscope.modeling.profile.WorkloadProfile.fit_note`), data loading, the device, and the cache file.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    b = profile.batch_sizes[-1]
    extrapolated = " (extrapolated)" if profile.steps[-1].extrapolated else ""
    layers = Table(title=f"{profile.network} on {profile.dataset} {profile.input_shape}, batch {b}{extrapolated}: "
                         "per layer")
    for col in ("layer", "fwd ms", "bwd ms", "params MB", "out KB/sample", "saved KB/sample", "MFLOP/sample"):
        layers.add_column(col, justify="left" if col == "layer" else "right", overflow="fold", no_wrap=col == "layer")
    for layer in profile.layers:
        layers.add_row(escape(layer.name), f"{layer.forward_s[-1] * 1e3:.2f}", f"{layer.backward_s[-1] * 1e3:.2f}",
                       f"{layer.param_bytes / 1e6:.2f}", f"{layer.output_bytes_per_sample / 1e3:.1f}",
                       f"{layer.saved_bytes_per_sample / 1e3:.1f}", f"{layer.forward_flops_per_sample / 1e6:.1f}")
    console.print(layers)
    trained = profile.optimizer_setting.label() if profile.optimizer_setting else profile.optimizer
    steps = Table(title=f"training step ({trained}; median)")
    for col in ("batch", "fwd ms", "bwd ms", "optimizer ms", "step ms", "samples/s", "activations MB (fake)",
                "activations MB (measured)"):
        steps.add_column(col, justify="right", overflow="fold")
    for s in profile.steps:
        measured = "-" if s.measured_activation_peak_bytes is None else f"{s.measured_activation_peak_bytes / 1e6:.1f}"
        steps.add_row(f"{s.batch_size}{'*' if s.extrapolated else ''}", f"{s.forward_s * 1e3:.1f}",
                      f"{s.backward_s * 1e3:.1f}",
                      f"{s.optimizer_s * 1e3:.1f}", f"{s.step_s * 1e3:.1f}",
                      f"{s.batch_size / s.step_s:.1f}" if s.step_s > 0 else "-",
                      f"{s.activation_peak_bytes / 1e6:.1f}", measured)
    console.print(steps)
    if profile.fit_note():
        console.print(f"{profile.fit_note()} (* above)", markup=False)
    console.print(f"model: {profile.param_count:,} parameters, {profile.param_bytes / 1e6:.1f} MB; buffers "
                  f"{profile.buffer_bytes / 1e6:.2f} MB; optimizer state {profile.optimizer_state_bytes / 1e6:.1f} MB")
    kept, fixed = profile.retained_step, profile.first_training_bytes()
    if kept is not None:  # CPU: what a worker keeps beyond its live tensors, added to every worker's predicted peak
        measured_at = sorted({s.batch_size for s in profile.steps if s.retained_bytes is not None})
        console.print(f"kept beyond the live tensors (glibc's defaults, batch {', '.join(map(str, measured_at))}): "
                      + (f"{fixed / 1e6:.1f} MB per process whatever the batch + " if fixed is not None else "")
                      + f"{profile.retained_share():.2f} of the gradients and activations", markup=False)
    elif profile.device.type == "cpu":  # unknown, not none: the probe's measurement failed
        console.print("kept beyond the live tensors (glibc's defaults): - (not measured: the memory probe's growth "
                      "processes gave no result; the memory model adds none)", markup=False)
    for d in profile.data_loading:
        console.print(f"data loading, {d.loader_workers} loader worker(s): {d.samples_per_s:,.0f} samples/s",
                      markup=False)
    dev = profile.device
    console.print(f"device: {dev.type} {dev.name}, {dev.threads} thread(s): {dev.peak_tflops * 1e3:.0f} GFLOP/s "
                  f"float32 matmul, {dev.memory_bandwidth_gb_per_s:.1f} GB/s copy, capacity "
                  f"{dev.memory_bytes / 2**30:.1f} GiB, runtime {dev.runtime_bytes / 2**20:.0f} MiB", markup=False)
    console.print(f"torch {profile.torch_version}; measured in {profile.profile_s:.1f} s", markup=False)
    if path is not None:
        console.print(f"cache: {path}", markup=False)


OPTIMIZER_HELP = ("sgd, adam or adamw, with the run config's default hyperparameters (the optimizer's state, "
                  "e.g. Adam's two moments, counts in the memory estimate)")


def register(app: typer.Typer) -> None:
    """Add the predictor's commands to ``app``."""
    # ---- profile (profiling/profile.py)
    @app.command("profile")
    def profile(
        model: str = typer.Option(..., "--model", help="zoo network, e.g. resnet18"),
        dataset: str = typer.Option(..., "--dataset", help="mnist, cifar10, imagenet, highres or digits"),
        batch_size: int = typer.Option(..., "--batch-size", help="samples per step; its halvings are measured too"),
        threads: int = typer.Option(1, "--threads", help="intra-op threads of the device (CPU cores)"),
        loader_workers: str = typer.Option("0,1", "--loader-workers", help="DataLoader worker counts to time"),
        device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
        refresh: bool = typer.Option(False, "--refresh", help="measure again even if a cached profile exists"),
        json_: bool = typer.Option(False, "--json", help="print the profile as JSON only (progress goes to stderr)"),
        cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="profile cache (default ./ddlscope-results/profiles)"),
        data_root: Optional[Path] = typer.Option(None, "--data-root", help="where a local dataset copy is looked for"),
        optimizer: str = typer.Option("sgd", "--optimizer", help=OPTIMIZER_HELP),
        memory_limit_gib: Optional[float] = typer.Option(
            None, "--memory-limit-gib", help="memory a training step may use (GiB; default: the device's); batch "
                                             "sizes that need more are not run, their times are extrapolated"),
    ):
        """Measure a workload on this device (per-layer times and bytes, steps, data loading); cached.

        Batch sizes that do not fit the device (or --memory-limit-gib) are not run: their times are
        extrapolated from the largest ones that fit, and the profile says so."""
        from ddlscope.cli import echo_json, stdout_to_stderr
        from ddlscope.profiling.profile import load_or_profile, profile_path

        workers = parse_worker_counts(loader_workers)
        if memory_limit_gib is not None and not memory_limit_gib * 2**30 >= 1:
            raise UserError(f"--memory-limit-gib {memory_limit_gib}; allowed: a number of GiB > 0, e.g. 12")
        limit = None if memory_limit_gib is None else int(memory_limit_gib * 2**30)
        with stdout_to_stderr(json_):
            prof = load_or_profile(model, dataset, batch_size, device, threads, workers, data_root=data_root,
                                   cache_dir=cache_dir, refresh=refresh, progress=not json_, optimizer=optimizer,
                                   memory_limit_bytes=limit)
        if json_:
            echo_json(prof.model_dump(mode="json"))
        else:
            print_profile(prof, profile_path(model, dataset, batch_size, device, threads, workers, cache_dir, optimizer,
                                             limit))

    # ---- calibrate (profiling/calibrate.py)
    @app.command("calibrate")
    def calibrate_cmd(
        ctx: typer.Context,
        workers: int = typer.Option(2, "--workers", help="local worker processes (>= 2), one device each"),
        threads: int = typer.Option(1, "--threads", help="cores and intra-op threads per worker"),
        out: Path = typer.Option(Path("cluster.toml"), "--out", help="cluster file to write (TOML)"),
        quick: bool = typer.Option(False, "--quick", help="4 sizes (4 KiB..8 MiB), 10 repeats and, with --hivemind, swarms of 4 timed epochs instead of 10: for tests and a first look"),
        repeats: Optional[int] = typer.Option(None, "--repeats", help="timed repeats per size (default 20, --quick 10)"),
        timeout_s: float = typer.Option(300.0, "--timeout-s", help="give up (and stop every worker) when no measurement finishes for this many seconds"),
        json_out: bool = typer.Option(False, "--json", help="print the measurements and the fit as JSON on stdout"),
        hivemind: bool = typer.Option(False, "--hivemind", help="also train a network (--swarm-network, default ResNet-18) in short local hivemind swarms "
                                      "(~3 min on 2 cores, ~2 with --quick) to measure what hivemind adds per global epoch (collaborative)"),
        matchmaking_time_s: float = typer.Option(1.0, "--matchmaking-time-s", min=0.01,
                                                 help="--hivemind: the swarm's matchmaking time in seconds; use the "
                                                 "one you will predict for (overhead and overshoot depend on it)"),
        old_matchmaking_time: Optional[float] = typer.Option(None, "--matchmaking-time", min=0.01, hidden=True,
                                                             help="old name of --matchmaking-time-s"),
        dmoe: bool = typer.Option(False, "--dmoe", help="also time hivemind's beam searches and remote expert calls "
                                  "between an expert server and a client (about 35 s) to fit what they cost (dmoe)"),
        swarm_network: str = typer.Option("resnet18", "--swarm-network", help="--hivemind: the zoo network the swarms "
                                          "train; how far peers overshoot the target batch depends on it, so use "
                                          "the one you will predict for"),
        swarm_dataset: str = typer.Option("mnist", "--swarm-dataset", help="--hivemind: the swarms' dataset shape"),
        swarm_batch_sizes: str = typer.Option("32,8", "--swarm-batch-sizes", help="--hivemind: samples per step of "
                                              "each swarm, comma-separated (one swarm each); your batch per peer "
                                              "predicts your overshoot best"),
    ):
        """Measure all-reduce and point-to-point among local workers; fit latency, bandwidth, fixed costs.

        Writes a cluster description (one node of WORKERS devices of kind 'local') that the
        predictor reads; thesis 002 used NVIDIA's p2pBandwidthLatencyTest for the same purpose.
        """
        from ddlscope.cli import echo_json, renamed, stdout_to_stderr
        from ddlscope.profiling import calibrate as cal
        from ddlscope.modeling.cluster import write_cluster

        matchmaking_time_s = renamed(ctx, "matchmaking_time_s", "old_matchmaking_time")
        if out.exists() and out.is_dir():
            raise UserError(f"--out {out} is a folder; allowed: a file path, e.g. {out / 'cluster.toml'}")
        if timeout_s <= 0:
            raise UserError(f"--timeout-s {timeout_s:g}; allowed: > 0")
        try:
            swarm_batches = [int(b) for b in swarm_batch_sizes.split(",") if b.strip()]
        except ValueError:
            raise UserError(f"--swarm-batch-sizes {swarm_batch_sizes!r}; allowed: whole numbers >= 1, "
                            "comma-separated, e.g. 32,8") from None
        sizes = cal.QUICK_SIZES_BYTES if quick else cal.DEFAULT_SIZES_BYTES
        reps = repeats if repeats is not None else (cal.QUICK_REPEATS if quick else cal.DEFAULT_REPEATS)
        try:
            with stdout_to_stderr(json_out):
                result = cal.calibrate(workers=workers, threads=threads, sizes_bytes=sizes, repeats=reps,
                                       timeout_s=timeout_s, progress=lambda msg: typer.echo(msg, err=True),
                                       hivemind=hivemind, matchmaking_time_s=matchmaking_time_s, dmoe=dmoe,
                                       swarm_epochs=cal.QUICK_SWARM_EPOCHS if quick else None,
                                       swarm_reference=(swarm_network, swarm_dataset), swarm_batch_sizes=swarm_batches)
        except cal.CalibrationError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.echo("interrupted: every calibration worker was stopped; nothing written", err=True)
            raise typer.Exit(130) from None
        path = write_cluster(result.cluster, out, header=cal.header_comment(result))
        if json_out:
            echo_json(result.model_dump(mode="json"))
        else:
            cal.print_calibration(result)
        typer.echo(f"wrote {path}", err=True)

    # ---- recommend (predict/recommend.py)
    @app.command("recommend")
    def recommend_cmd(
        ctx: typer.Context,
        model: str = typer.Option("resnet18", "--model", help="zoo network"),
        dataset: str = typer.Option("cifar10", "--dataset", help="dataset shape (mnist, cifar10, imagenet, highres, digits)"),
        cluster: Path = typer.Option(..., "--cluster", help="cluster TOML (`ddlscope examples` lists the shipped ones, e.g. examples/cluster-2x4xa100.toml; ddlscope calibrate writes one)"),
        batch_size: int = typer.Option(64, "--batch-size", min=1, help="global batch: samples per optimizer step"),
        workers: Optional[int] = typer.Option(None, "--workers", min=2, help="workers/peers (default: --swarm's peers, else the cluster's devices or peers)"),
        strategies: str = typer.Option(",".join(m.name for m in distribution.all_models() if m.cost_model),
                                       "--strategies", help="distribution models to consider, comma-separated"),
        microbatches: Optional[int] = typer.Option(None, "--microbatches", min=1, help="gpipe/1f1b (default 2 x workers)"),
        target_batch_size: Optional[int] = typer.Option(None, "--target-batch-size", min=1, help="collaborative (default: the global batch)"),
        matchmaking_time_s: Optional[float] = typer.Option(
            None, "--matchmaking-time-s", min=0.01,
            help="collaborative: seconds (default: the matchmaking time the cluster's hivemind calibration was "
                 f"measured at, else a run's default, {DEFAULT_MATCHMAKING_TIME_S:g} s)"),
        old_matchmaking_time: Optional[float] = typer.Option(None, "--matchmaking-time", min=0.01, hidden=True,
                                                             help="old name of --matchmaking-time-s"),
        local_updates: bool = typer.Option(False, "--local-updates", help="collaborative: use_local_updates"),
        loader_workers: int = typer.Option(0, "--loader-workers", min=0),
        threads: int = typer.Option(1, "--threads", min=1, help="cores of the profiled device (CPU)"),
        device: str = typer.Option("cpu", "--device", help="cpu or cuda: the device the workload is profiled on (a "
                                   "cluster of kind 'local' is that device; other kinds are scaled from it)"),
        cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="profile cache (default <results>/profiles)"),
        as_json: bool = typer.Option(False, "--json", help="print the ranking as JSON only (progress goes to stderr)"),
        optimizer: str = typer.Option("sgd", "--optimizer", help=OPTIMIZER_HELP),
        swarm: Optional[Path] = typer.Option(
            None, "--swarm", help="collaborative: a run config TOML whose [collaborative] table describes the swarm "
                                  "(auxiliary and client-mode peers, groups, declared bandwidths, churn with the "
                                  "run's time_limit_s); flags given here win over it"),
    ):
        """Rank the distribution models for a job on a cluster and recommend the fastest that fits."""
        from ddlscope.cli import echo_json, renamed, stdout_to_stderr
        from ddlscope.modeling.cluster import load_cluster
        from ddlscope.modeling.devices import check_profile_device, compute_scale
        from ddlscope.modeling.recommend import candidate_settings, recommend
        from ddlscope.profiling.profile import load_or_profile
        from ddlscope.workloads.datasets import DATASETS

        matchmaking_time_s = renamed(ctx, "matchmaking_time_s", "old_matchmaking_time")
        check_profile_device(device)
        spec = load_cluster(cluster)
        if dataset not in DATASETS:
            raise UserError(f"unknown dataset {dataset!r}; allowed: {', '.join(sorted(DATASETS))}")
        swarm_cfg, emulated_rates = None, None
        if swarm is not None:
            from ddlscope.config import load_config

            swarm_cfg = load_config(swarm)
        n = workers or (swarm_cfg.peers if swarm_cfg is not None else
                        len(spec.peers) if spec.peers and spec.workers == 1 else spec.workers)
        if n < 2:
            raise UserError(f"the cluster {spec.name!r} has one device; describe at least 2 devices or peers, or pass --workers")
        if swarm_cfg is not None and swarm_cfg.network.emulate:  # the swarm's emulated links, unlimited ones as the cluster's
            own = spec.intra_node.bandwidth_gb_per_s * 8e3
            emulated_rates = [min(up or own, down or own) for up, down in swarm_cfg.network.rates(n)]
        if matchmaking_time_s is None and spec.hivemind is not None:  # predict where the overhead was measured
            matchmaking_time_s = spec.hivemind.matchmaking_time_s  # None (unrecorded): the run default
        swarm_opts = {}
        if swarm_cfg is not None:
            from ddlscope.distribution.collaborative import swarm_options

            swarm_opts = swarm_options(swarm_cfg)
            given = {"target_batch_size": target_batch_size, "matchmaking_time_s": matchmaking_time_s,
                     "use_local_updates": local_updates or None}
            swarm_opts.update({k: v for k, v in given.items() if v is not None})
        settings = candidate_settings([x.strip() for x in strategies.split(",") if x.strip()], n, batch_size,
                                      DATASETS[dataset].train_size, microbatches=microbatches,
                                      loader_workers=loader_workers, target_batch_size=target_batch_size,
                                      matchmaking_time_s=matchmaking_time_s, use_local_updates=local_updates,
                                      model_options=swarm_opts)
        with stdout_to_stderr(as_json):
            profile = load_or_profile(model, dataset, batch_size, device, threads=threads,
                                      loader_workers=(loader_workers,), cache_dir=cache_dir, progress=not as_json,
                                      optimizer=optimizer)
        if emulated_rates is not None:  # the swarm's links; hivemind's rounds and fsdp's collectives as measured there
            from ddlscope.modeling.links import averaging_goodput, fsdp_goodput, links_goodput, over_links

            rounds_share = averaging_goodput(emulated_rates, n, profile.param_bytes) \
                if any(distribution.get(s.strategy).averages_with_hivemind for s in settings) else None
            gloo_share = fsdp_goodput(emulated_rates, n, [layer.param_bytes for layer in profile.layers]) \
                if profile.device.type == "cpu" and any(distribution.get(s.strategy).gathers_units for s in settings) \
                else None
            spec = over_links(spec, emulated_rates, n, links_goodput(emulated_rates, n, swarm_cfg.network.bucket_ms),
                              rounds_share, gloo_share, bucket_ms=swarm_cfg.network.bucket_ms)
        scale = compute_scale(profile, batch_size, spec.device.kind)
        rec = recommend(profile, spec, settings, scale.factor, (scale.low, scale.high))
        if spec.device.kind != "local":
            rec.notes.append(f"compute scaled from {profile.device.name} to {spec.device.kind}: x{scale.factor:.3g} "
                             f"(band x{scale.low:.3g} .. x{scale.high:.3g}; {scale.method})")
            rec.notes.extend(scale.warnings)
        if as_json:
            echo_json(rec.to_dict())
        else:
            print_recommendation(rec, f"{model} on {dataset}, global batch {batch_size}, cluster {spec.name}")

    # ---- validate (experiments/validate.py)
    @app.command("validate")
    def validate_cmd(
        grid: str = typer.Argument("local", metavar="GRID", help="grid TOML ([validation] table) or preset: "
                                   "local, moe, links, moe-links, churn, tiny"),
        cluster: Optional[Path] = typer.Option(None, "--cluster", help="cluster TOML of this machine (default: calibrate now, kept next to the database)"),
        out: Optional[Path] = typer.Option(None, "--out", help="report folder (default <results>/validation/<name>)"),
        rerun: bool = typer.Option(False, "--rerun", help="run cells again even if a completed run is stored"),
        predict_only: bool = typer.Option(False, "--predict-only", help="store and report predictions, run nothing"),
        db: Optional[Path] = typer.Option(None, "--db", help="results database (default ./ddlscope-results/ddlscope.db)"),
        progress: bool = typer.Option(True, "--progress/--no-progress"),
        device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda: where the workloads are profiled and "
                                             "the cells run (default: the grid's device, cpu unless it says)"),
        repeats: Optional[int] = typer.Option(None, "--repeats", min=1, max=10,
                                              help="real runs per cell, 1-10; a cell shows its median run and the "
                                                   "spread (default: the grid's repeats, 1 unless it says)"),
        profile_each_repeat: Optional[bool] = typer.Option(
            None, "--profile-each-repeat/--one-profile",
            help="profile again before each repeat's runs and predict them from it, for a machine whose speed drifts "
                 "(default: the grid's profile_each_repeat)"),
        hivemind_each_repeat: Optional[bool] = typer.Option(
            None, "--hivemind-each-repeat/--one-hivemind-fit",
            help="with a profile per repeat: measure hivemind's fit and averaging share again before each repeat's "
                 "runs too; --one-hivemind-fit predicts every round from the cluster's fit (default: the grid's "
                 "hivemind_each_repeat, off)"),
        hivemind_per_workload: Optional[bool] = typer.Option(
            None, "--hivemind-per-workload/--one-hivemind-fit-for-all",
            help="a grid of several networks or datasets: measure hivemind's fit for each at the grid's batch per "
                 "peer and predict its swarm cells from it; --one-hivemind-fit-for-all predicts every workload from "
                 "the cluster's fit (default: the grid's hivemind_per_workload, on)"),
        as_json: bool = typer.Option(False, "--json", help="print the validation (the report's validation.json and its "
                                                           "path) as JSON on stdout; everything else goes to stderr"),
    ):
        """Predict every cell of a grid, run it for real here, and report error, recommendation correctness and regret."""
        from ddlscope.cli import echo_json, stdout_to_stderr
        from ddlscope.experiments.validate import calibration_options, load_grid, missing_fits, run_validation
        from ddlscope.modeling.devices import check_profile_device
        from ddlscope.predict.validation_report import print_validation, write_validation_report
        from ddlscope.launch.processes import sigterm_as_interrupt
        from ddlscope.store.db import default_db_path

        spec = load_grid(grid)
        if device is not None:
            spec = spec.model_copy(update={"device": device})
        if repeats is not None:
            spec = spec.model_copy(update={"repeats": repeats})
        if profile_each_repeat is not None:
            spec = spec.model_copy(update={"profile_each_repeat": profile_each_repeat})
        if hivemind_each_repeat is not None:
            spec = spec.model_copy(update={"hivemind_each_repeat": hivemind_each_repeat})
        if hivemind_per_workload is not None:
            spec = spec.model_copy(update={"hivemind_per_workload": hivemind_per_workload})
        if spec.device == "cuda" and cluster is None:
            raise UserError("validate on cuda needs --cluster FILE: calibrating this machine times gloo collectives "
                            "between CPU cores, not nccl between GPUs; allowed: --cluster with kind = \"local\" and "
                            "the GPUs' [cluster.link] figures, or --device cpu")
        check_profile_device(spec.device)
        db_path = Path(db) if db else default_db_path()
        with stdout_to_stderr(as_json):
            cl = _local_cluster(cluster, db_path, spec.workers, spec.threads, calibration_options(spec))
            lacking = missing_fits(spec, cl, str(cluster)) if cluster is not None else None
            if lacking:  # said before anything runs: the pass would measure the missing fit as the models' error
                typer.echo(f"warning: {lacking}", err=True)
            # SIGTERM as Ctrl-C: the running cell or probe stops its processes, namespaces and temporary folders
            try:
                with sigterm_as_interrupt():
                    cells = run_validation(spec, cl, db_path, progress=progress, rerun=rerun, run_real=not predict_only)
            except KeyboardInterrupt:
                typer.echo("interrupted: finished cells are stored; run the same command again to resume", err=True)
                raise typer.Exit(130)
            folder = out or db_path.parent / "validation" / spec.name
            path = write_validation_report(cells, folder, f"Predictor validation: {spec.name}",
                                           extra={"cluster": cl.model_dump(), "grid": spec.model_dump()})
            if not as_json:
                print_validation(cells)
            typer.echo(f"report: {path}")
        if as_json:
            echo_json({"report": str(path), **json.loads(path.with_name("validation.json").read_text())})


def _local_cluster(path: Path | None, db_path: Path, workers: int, threads: int, options: dict[str, Any]):
    """The cluster file given, or this machine calibrated once with ``options`` (the grid's
    :func:`ddlscope.experiments.validate.calibration_options`: which fits, the matchmaking time, the
    swarms' network and batch) and kept next to the database, in a file named after them."""
    from ddlscope.modeling.cluster import load_cluster, write_cluster

    if path is not None:
        return load_cluster(path)
    name = f"cluster-calibrated-{workers}x{threads}"
    if options.get("hivemind"):
        name += f"-mm{options['matchmaking_time_s']:g}s"
        if options.get("swarm_reference"):
            name += f"-{'-'.join(options['swarm_reference'])}-b{'-'.join(map(str, options['swarm_batch_sizes']))}"
    if options.get("dmoe"):
        name += "-dmoe"
    kept = db_path.parent / f"{name}.toml"
    if kept.exists():
        return load_cluster(kept)
    from ddlscope.profiling.calibrate import calibrate

    typer.echo(f"calibrating this machine ({workers} workers x {threads} threads) ...", err=True)
    spec = calibrate(workers=workers, threads=threads, **options).cluster
    write_cluster(spec, kept)
    return spec


def print_recommendation(rec, title: str, console=None) -> None:
    """The ranked candidates as a rich table, then the recommendation and why.

    Args:
        console: a :class:`rich.console.Console`; default one on stdout at the terminal's width
            (columns wrap or fold when it is narrow).
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title))
    for col in ("#", "distribution model", "batch/worker", "s/epoch", "step s", "memory/worker", "capacity",
                "fits", "dominant cost", "thesis reference s/epoch"):
        table.add_column(col, justify="right" if col not in ("distribution model", "dominant cost", "fits") else "left",
                         overflow="fold")
    for i, c in enumerate(rec.candidates, 1):
        p, s = c.prediction, c.setting
        per = f"{s.batch_size}" + (f" ({s.microbatches} mb)" if s.microbatches else "")
        ref = ", ".join(f"{k} {v:.1f}" for k, v in (p.reference_epoch_s.items() if p else []))
        gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
        table.add_row(*map(escape, (
            str(i), f"{s.strategy} x{s.workers}", per, f"{p.epoch_s:.1f}" if p else "-",
            f"{p.step_s:.3f}" if p else "-", gib(c.memory_bytes), gib(c.capacity_bytes),
            "yes" if c.fits else ("no" if c.invalid_reason is None else "invalid"),
            p.dominant_cost if p else (c.invalid_reason or "")[:60], ref or "-")))
    console = console or Console()
    console.print(table)
    for note in rec.notes:
        console.print(f"note: {note}", markup=False)
    head = f"recommended: {rec.best.label}" if rec.best else "no recommendation"
    console.print(f"[bold]{escape(head)}[/bold] — {escape(rec.why)}")

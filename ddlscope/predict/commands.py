"""CLI commands of the predictor: ``profile``, ``calibrate``, ``recommend``, ``validate``.

:func:`register` adds them to the main ``ddlscope`` app (kept here so that the predictor's
commands read together). User errors raise :class:`~ddlscope.errors.UserError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

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
    """Print a :class:`~ddlscope.predict.profile.WorkloadProfile` as rich tables.

    Per layer at the requested (largest) batch size: forward/backward ms, parameter MB,
    output / saved KB per sample, forward MFLOP per sample; then the whole step per batch size,
    data loading, the device, and the cache file.
    """
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=160)
    b = profile.batch_sizes[-1]
    layers = Table(title=f"{profile.network} on {profile.dataset} {profile.input_shape}, batch {b}: per layer")
    for col in ("layer", "fwd ms", "bwd ms", "params MB", "out KB/sample", "saved KB/sample", "MFLOP/sample"):
        layers.add_column(col, justify="left" if col == "layer" else "right")
    for layer in profile.layers:
        layers.add_row(layer.name, f"{layer.forward_s[-1] * 1e3:.2f}", f"{layer.backward_s[-1] * 1e3:.2f}",
                       f"{layer.param_bytes / 1e6:.2f}", f"{layer.output_bytes_per_sample / 1e3:.1f}",
                       f"{layer.saved_bytes_per_sample / 1e3:.1f}", f"{layer.forward_flops_per_sample / 1e6:.1f}")
    console.print(layers)
    steps = Table(title="training step (SGD, momentum 0.9; median)")
    for col in ("batch", "fwd ms", "bwd ms", "optimizer ms", "step ms", "samples/s", "activations MB (fake)",
                "activations MB (measured)"):
        steps.add_column(col, justify="right")
    for s in profile.steps:
        measured = "-" if s.measured_activation_peak_bytes is None else f"{s.measured_activation_peak_bytes / 1e6:.1f}"
        steps.add_row(str(s.batch_size), f"{s.forward_s * 1e3:.1f}", f"{s.backward_s * 1e3:.1f}",
                      f"{s.optimizer_s * 1e3:.1f}", f"{s.step_s * 1e3:.1f}",
                      f"{s.batch_size / s.step_s:.1f}" if s.step_s > 0 else "-",
                      f"{s.activation_peak_bytes / 1e6:.1f}", measured)
    console.print(steps)
    console.print(f"model: {profile.param_count:,} parameters, {profile.param_bytes / 1e6:.1f} MB; buffers "
                  f"{profile.buffer_bytes / 1e6:.2f} MB; optimizer state {profile.optimizer_state_bytes / 1e6:.1f} MB")
    for d in profile.data_loading:
        console.print(f"data loading, {d.loader_workers} loader worker(s): {d.samples_per_s:,.0f} samples/s")
    dev = profile.device
    console.print(f"device: {dev.type} {dev.name}, {dev.threads} thread(s): {dev.peak_tflops * 1e3:.0f} GFLOP/s "
                  f"float32 matmul, {dev.memory_bandwidth_gb_per_s:.1f} GB/s copy, capacity "
                  f"{dev.memory_bytes / 2**30:.1f} GiB, runtime {dev.runtime_bytes / 2**20:.0f} MiB")
    console.print(f"torch {profile.torch_version}; measured in {profile.profile_s:.1f} s")
    if path is not None:
        console.print(f"cache: {path}")


def register(app: typer.Typer) -> None:
    """Add the predictor's commands to ``app``."""
    # ---- profile (predict/profile.py)
    @app.command("profile")
    def profile(
        model: str = typer.Option(..., "--model", help="zoo network, e.g. resnet18"),
        dataset: str = typer.Option(..., "--dataset", help="mnist, cifar10, imagenet, highres or digits"),
        batch_size: int = typer.Option(..., "--batch-size", help="samples per step; its halvings are measured too"),
        threads: int = typer.Option(1, "--threads", help="intra-op threads of the device (CPU cores)"),
        loader_workers: str = typer.Option("0,1", "--loader-workers", help="DataLoader worker counts to time"),
        device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
        refresh: bool = typer.Option(False, "--refresh", help="measure again even if a cached profile exists"),
        json_: bool = typer.Option(False, "--json", help="print the profile as JSON only"),
        cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="profile cache (default ./ddlscope-results/profiles)"),
        data_root: Optional[Path] = typer.Option(None, "--data-root", help="where a local dataset copy is looked for"),
    ):
        """Measure a workload on this device (per-layer times and bytes, steps, data loading); cached."""
        from ddlscope.predict.profile import load_or_profile, profile_path

        workers = parse_worker_counts(loader_workers)
        prof = load_or_profile(model, dataset, batch_size, device, threads, workers, data_root=data_root,
                               cache_dir=cache_dir, refresh=refresh, progress=not json_)
        if json_:
            typer.echo(prof.model_dump_json(indent=2))
        else:
            print_profile(prof, profile_path(model, dataset, batch_size, device, threads, workers, cache_dir))

    # ---- calibrate (predict/calibrate.py)

    # ---- recommend (predict/recommend.py)

    # ---- validate (predict/validate.py)

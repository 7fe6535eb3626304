"""CLI commands of the predictor: ``profile``, ``calibrate``, ``recommend``, ``validate``.

:func:`register` adds them to the main ``ddlscope`` app (kept here so that the predictor's
commands read together). User errors raise :class:`~ddlscope.errors.UserError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ddlscope.errors import UserError


def register(app: typer.Typer) -> None:
    """Add the predictor's commands to ``app``."""
    # ---- profile (predict/profile.py)

    # ---- calibrate (predict/calibrate.py)
    @app.command("calibrate")
    def calibrate_cmd(
        workers: int = typer.Option(2, "--workers", help="local worker processes (>= 2), one device each"),
        threads: int = typer.Option(1, "--threads", help="cores and intra-op threads per worker"),
        out: Path = typer.Option(Path("cluster.toml"), "--out", help="cluster file to write (TOML)"),
        quick: bool = typer.Option(False, "--quick", help="4 sizes (4 KiB..8 MiB), 5 repeats: a few seconds"),
        repeats: Optional[int] = typer.Option(None, "--repeats", help="timed repeats per size (default 20, --quick 5)"),
        timeout_s: float = typer.Option(300.0, "--timeout-s", help="give up (and stop every worker) after this long"),
        json_out: bool = typer.Option(False, "--json", help="print the measurements and the fit as JSON on stdout"),
    ):
        """Measure all-reduce and point-to-point among local workers; fit latency, bandwidth, fixed costs.

        Writes a cluster description (one node of WORKERS devices of kind 'local') that the
        predictor reads; thesis 002 used NVIDIA's p2pBandwidthLatencyTest for the same purpose.
        """
        from ddlscope.predict import calibrate as cal
        from ddlscope.predict.cluster import write_cluster

        if out.exists() and out.is_dir():
            raise UserError(f"--out {out} is a folder; allowed: a file path, e.g. {out / 'cluster.toml'}")
        if timeout_s <= 0:
            raise UserError(f"--timeout-s {timeout_s:g}; allowed: > 0")
        sizes = cal.QUICK_SIZES_BYTES if quick else cal.DEFAULT_SIZES_BYTES
        reps = repeats if repeats is not None else (cal.QUICK_REPEATS if quick else cal.DEFAULT_REPEATS)
        try:
            result = cal.calibrate(workers=workers, threads=threads, sizes_bytes=sizes, repeats=reps,
                                   timeout_s=timeout_s, progress=lambda msg: typer.echo(msg, err=True))
        except cal.CalibrationError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.echo("interrupted: every calibration worker was stopped; nothing written", err=True)
            raise typer.Exit(130) from None
        path = write_cluster(result.cluster, out, header=cal.header_comment(result))
        if json_out:
            typer.echo(result.model_dump_json(indent=2))
        else:
            cal.print_calibration(result)
        typer.echo(f"wrote {path}", err=True)

    # ---- recommend (predict/recommend.py)

    # ---- validate (predict/validate.py)

"""`bapo-nemo report --experiment NAME [--runs RUN_ID_OR_NAME ...] [--tracking-uri URI] [--out DIR]`."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bapo_nemo.tracking.redact import redact_text


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  bapo-nemo report --experiment bapo-embedded --tracking-uri sqlite:///runs/local_cpu/mlflow.db\n"
        "  bapo-nemo report --experiment bapo-embedded --tracking-uri sqlite:///runs/local_cpu/mlflow.db "
        "--runs local_cpu --out report/ --no-log\n"
        "  MLFLOW_TRACKING_URI=http://mlflow.internal:5000 bapo-nemo report --experiment bapo "
        "--runs bapo_7b bapo_32b"
    )
    parser.add_argument("--experiment", required=True, help="MLflow experiment name")
    parser.add_argument("--runs", nargs="+", metavar="RUN_ID_OR_NAME",
                        help="runs to compare, by id or name (default: every run of the experiment)")
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                        help="sqlite:///path/mlflow.db or http://host:port (default: $MLFLOW_TRACKING_URI)")
    parser.add_argument("--out", help="output directory (default: report_<experiment>/ beside a sqlite store, "
                        "i.e. in the run's directory; a new temporary directory for a server store)")
    parser.add_argument("--no-log", action="store_true", help="do not log the report back to the runs")


def default_out_dir(tracking_uri: str, experiment: str) -> str:
    """Beside the sqlite store (an embedded run's own directory), never the current directory; for a server
    store, whose runs get the report as artifacts anyway, a fresh temporary directory."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment)
    if tracking_uri.startswith("sqlite:///"):
        return str(Path(tracking_uri[len("sqlite:///"):]).expanduser().resolve().parent / f"report_{safe}")
    return tempfile.mkdtemp(prefix=f"bapo_report_{safe}_")


def main(args: argparse.Namespace) -> int:
    from bapo_nemo.tracking.report import ReportError, build_report
    from bapo_nemo.tracking.store import TrackingConfigError

    if not args.tracking_uri:
        print("bapo-nemo report: error: no tracking URI: pass --tracking-uri (e.g. sqlite:///runs/x/mlflow.db) "
              "or set MLFLOW_TRACKING_URI", file=sys.stderr)
        return 2
    out = args.out or default_out_dir(args.tracking_uri, args.experiment)
    try:
        result = build_report(args.tracking_uri, args.experiment, args.runs, out, log_to_runs=not args.no_log)
    except (ReportError, TrackingConfigError) as exc:
        if not args.out and Path(out).is_dir() and not any(Path(out).iterdir()):
            Path(out).rmdir()  # the default directory was made for nothing
        print(f"bapo-nemo report: error: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    from bapo_nemo.tracking.report_stats import comparison_lines

    print(f"{len(result.runs)} runs: {', '.join(r.label for r in result.runs)}")
    for line in comparison_lines(result.runs):
        print(line)
    print(f"wrote {result.png}")
    print(f"wrote {result.html}")
    if not args.no_log:
        print("logged both to each run under artifacts/report/")
    return 0

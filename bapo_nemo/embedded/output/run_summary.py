"""What `bapo-nemo train` prints when it ends: for a person (`summary_text`: the held-out score at the start
of RL (after the warm-up, if any) and at the end, where the plot and the final model are, and the commands
to look at the run), or with `--json` for a program (`summary_record`; a finished run also keeps the
trainer's whole summary in `<output_dir>/summary.json`).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

DEFAULT_MLFLOW_UI_PORT = 5000  # where `mlflow ui` serves unless --port or MLFLOW_PORT says otherwise


def mlflow_ui_port() -> int:
    """The port `mlflow ui` serves on here: MLFLOW_PORT (which mlflow ui reads) when set to a port, else 5000."""
    value = os.environ.get("MLFLOW_PORT", "").strip()
    return int(value) if value.isdigit() and 0 < int(value) < 65536 else DEFAULT_MLFLOW_UI_PORT


def summary_record(summary: dict[str, Any]) -> dict[str, Any]:
    """The facts a script reads, counts as integers."""
    start, end = summary.get("eval_start") or {}, summary.get("eval_end") or {}
    warmup_steps = (summary.get("warmup") or {}).get("warmup/steps")
    return {
        "step": int(summary["step"]),
        "stopped_by_signal": summary["stopped_by_signal"],
        "warmup_steps": None if warmup_steps is None else int(warmup_steps),
        "heldout_avg_at_k_start": start.get("eval/avg_at_k"),
        "heldout_avg_at_k_end": end.get("eval/avg_at_k"),
        "heldout_pass_at_k_end": end.get("eval/pass_at_k"),
        "mlflow_run_id": summary["mlflow_run_id"],
        "mlflow_tracking_uri": summary["mlflow_tracking_uri"],
        "output_dir": summary["output_dir"],
        "hf_final": summary.get("hf_final"),
        "plot": summary.get("plot"),
    }


def summary_text(summary: dict[str, Any], experiment: str, k: int, command: list[str],
                 beside: list[str] | None = None) -> str:
    """The end of a run in words. `command` is the `bapo-nemo train ...` argument list that ran it (the stop
    message repeats it with --resume); `beside`: the runs (names or ids) of a comparison (--compare-with),
    which the report command then names."""
    record = summary_record(summary)
    out = Path(record["output_dir"])
    lines = [_outcome(summary, record, out)]
    start, end = summary.get("eval_start"), summary.get("eval_end")
    if start is not None:
        when = "after the warm-up" if record["warmup_steps"] else "at the start (no warm-up)"
        score = f"  held-out avg@{k}: {start['eval/avg_at_k']:.3f} {when}"
        if end is not None and end["step"] != start["step"]:
            delta = end["eval/avg_at_k"] - start["eval/avg_at_k"]
            score += f" -> {end['eval/avg_at_k']:.3f} at step {end['step']} ({delta:+.3f})"
        lines.append(score)
    if record["plot"]:
        lines.append(f"  plot:        {shown_path(record['plot'])}")
    if record["hf_final"]:
        lines.append(f"  final model: {shown_path(record['hf_final'])}  (AutoModelForCausalLM.from_pretrained)")
    lines.append("next:")
    if record["stopped_by_signal"]:
        resume = command if "--resume" in command else [*command, "--resume"]
        lines.append(f"  {shlex.join(resume)}   # continue where it stopped")
    lines += [f"  {line}" for line in look_commands(record, experiment, summary.get("mlflow_experiment_id"), beside)]
    if not record["stopped_by_signal"]:
        lines.append(f"  (for scripts: {shown_path(out / 'summary.json')}, or --json)")
    return "\n".join(lines)


def look_commands(record: dict[str, Any], experiment: str, experiment_id: str | None,
                  runs: list[str] | None = None) -> list[str]:
    """`mlflow ui ...` with the page to open, and `bapo-nemo report ...` (of `runs`, else of every run of the
    experiment), for this run's store."""
    uri = record["mlflow_tracking_uri"]
    if uri.startswith("sqlite:///"):
        uri = "sqlite:///" + shown_path(uri[len("sqlite:///"):])
        port = mlflow_ui_port()  # said in the command too, so the address printed is the one it serves
        address, serve = f"http://127.0.0.1:{port}", f"mlflow ui --backend-store-uri {shlex.quote(uri)} --port {port}"
    else:
        address, serve = uri.rstrip("/"), None
    # MLflow 3.17's UI shows an experiment as a training one only with this parameter (or after the user
    # flips its sidebar switch): without it, it opens the GenAI view.
    page = (f"{address}/#/experiments/{experiment_id}/runs?workflowType=machine_learning" if experiment_id
            else address)
    lines = [f"{serve}   # then open {page}" if serve else f"open {page}"]
    report = f"bapo-nemo report --experiment {shlex.quote(experiment)} --tracking-uri {shlex.quote(uri)}"
    if runs:
        report += " --runs " + shlex.join(runs) + "   # both runs side by side"
    lines.append(report)
    return lines


def _outcome(summary: dict[str, Any], record: dict[str, Any], out: Path) -> str:
    where = shown_path(out)
    if not record["stopped_by_signal"]:
        warmup = f" after {record['warmup_steps']} warm-up steps" if record["warmup_steps"] else ""
        return f"finished {record['step']} RL steps{warmup} in {where}"
    if record["step"] == 0 and not summary.get("eval_start"):
        return (f"stopped by {record['stopped_by_signal']} during the warm-up ({record['warmup_steps'] or 0} "
                f"steps done, no checkpoint yet) in {where}")
    checkpoint = out / "checkpoints" / f"step_{record['step']}"
    return (f"stopped by {record['stopped_by_signal']} at step {record['step']} of {summary['max_steps']}, "
            f"checkpoint {shown_path(checkpoint)}")


def shown_path(path: str | Path) -> str:
    """The path as the user can type it here: relative to the current directory when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)

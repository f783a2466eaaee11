"""`bapo-nemo`: one entry point, one sub-command per job. Each sub-command lives in the module that owns
the work and exposes `configure_parser(parser)` and `main(args) -> int`; they are imported lazily so
that `bapo-nemo check` does not pay for torch/transformers start-up it does not need."""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("bapo_nemo.embedded.run.train_cli", "BAPO training on one machine with the embedded trainer (CPU or one GPU)"),
    "check": ("bapo_nemo.plan.check_cli", "validate a NeMo-RL config for a cluster shape and estimate per-GPU memory"),
    "report": ("bapo_nemo.tracking.report_cli", "training-dynamics panels for MLflow runs, as PNG and HTML"),
    "export": ("bapo_nemo.export.cli", "export a checkpoint to Hugging Face format, with a parity check"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bapo-nemo",
        description="BAPO (adaptive-clipping policy optimization) for NeMo-RL, and a single-machine trainer. "
        "The NeMo-RL driver runs as `python -m bapo_nemo.train --config CONFIG` inside the container.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).configure_parser(p)
        _add_debug_flag(p)
    return parser


def _add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback of an unexpected error (default: one line)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Build only the chosen sub-command's parser when one is named, so one broken module cannot take
    # down the others' --help.
    if argv and argv[0] in COMMANDS:
        name = argv[0]
        module = importlib.import_module(COMMANDS[name][0])
        parser = argparse.ArgumentParser(prog=f"bapo-nemo {name}", description=COMMANDS[name][1])
        module.configure_parser(parser)
        _add_debug_flag(parser)
        # intermixed: `train CONFIG --resume key=value` puts positional overrides after options.
        args = parser.parse_intermixed_args(argv[1:])
    else:
        parser = build_parser()
        args = parser.parse_args(argv)
        name, module = args.command, importlib.import_module(args._module)
    try:
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        if getattr(args, "debug", False):
            raise
        print(f"bapo-nemo {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # expected errors are reported by the sub-command; this is the last resort
        if getattr(args, "debug", False):
            raise
        print(unexpected_error_line(name, exc), file=sys.stderr)
        return 1


def unexpected_error_line(command: str, exc: BaseException) -> str:
    """The one line an unexpected error ends `bapo-nemo COMMAND` with (also the last line of a run's log)."""
    from bapo_nemo.tracking.redact import redact_text

    where = _innermost_frame(exc)
    return (f"bapo-nemo {command}: error: {type(exc).__name__}: {redact_text(str(exc))}{where} (run again with "
            "--debug for the traceback)")


def _innermost_frame(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" [at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}]" if tb is not None else ""


if __name__ == "__main__":
    sys.exit(main())

"""The signal lead of the batch script that runs a config (`#SBATCH --signal=B:USR1@SECONDS`), compared
with the lead the step-time estimate asks for."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# The checkout's slurm/ folder (absent from an installed wheel: then there is nothing to compare with).
SLURM_DIR = Path(__file__).resolve().parents[3] / "slurm"
_SIGNAL = re.compile(r"^#SBATCH\s+--signal=(?:[A-Z]*:)?(?:SIG)?USR1@(\d+)\s*$")


@dataclass(frozen=True)
class SignalLine:
    path: Path
    line_number: int
    line: str
    seconds: int


def shipped_sbatch(config_path: str | Path, slurm_dir: Path = SLURM_DIR) -> Path | None:
    """slurm/<config stem>.sbatch (configs/bapo_7b.yaml -> slurm/bapo_7b.sbatch), else the general
    slurm/bapo_32b.sbatch that any CONFIG can be submitted with."""
    for candidate in (slurm_dir / f"{Path(config_path).stem}.sbatch", slurm_dir / "bapo_32b.sbatch"):
        if candidate.is_file():
            return candidate
    return None


def signal_line(sbatch: Path) -> SignalLine | None:
    for number, line in enumerate(sbatch.read_text().splitlines(), start=1):
        match = _SIGNAL.match(line.strip())
        if match:
            return SignalLine(sbatch, number, line.strip(), int(match.group(1)))
    return None


def lead_warning(signal: SignalLine, recommended_s: int) -> str | None:
    """None when the script's lead covers the recommended one."""
    if signal.seconds >= recommended_s:
        return None
    return (
        f"{signal.path.name} line {signal.line_number} `{signal.line}` signals {signal.seconds}s before the "
        f"time limit, shorter than the estimated {recommended_s}s (one step + one save + margin): a step "
        f"running when the signal comes may not checkpoint before the limit. Submit with "
        f"`sbatch --signal=B:USR1@{recommended_s} ...` or edit that line"
    )

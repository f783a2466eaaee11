"""The README's commands as a newcomer copies them: on the first screen each set-up command is a code block
of its own, so copying the main job's block does not run the test suite too; the cluster block logs in to
nvcr.io before the build pulls the base image from there, and submits with the account and partition the
sbatch scripts leave to the command line."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def code_blocks(text: str) -> list[list[str]]:
    """The command lines of each fenced code block (comments and blank lines dropped)."""
    blocks = re.findall(r"```\w*\n(.*?)```", text, flags=re.DOTALL)
    return [[line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
            for block in blocks]


def section(title: str) -> str:
    return README.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_each_set_up_command_of_the_first_screen_is_a_block_of_its_own():
    blocks = code_blocks(section("On a fresh machine (Python >= 3.11, CPU is enough)"))
    set_ups = [block for block in blocks if any(line.startswith("python -m venv") for line in block)]
    assert len(set_ups) == 2, set_ups
    assert all(len(block) == 1 for block in set_ups), set_ups
    main_job, tests = set_ups[0][0], set_ups[1][0]
    assert main_job.endswith("&& bapo-nemo train configs/local_cpu.yaml") and "[test" not in main_job
    assert "-e '.[test," in tests and "bapo-nemo train" not in tests  # the suite's command, whatever runs it


def test_the_cluster_block_logs_in_to_nvcr_before_the_build_and_submits_with_account_and_partition():
    [block] = code_blocks(section("On a GPU cluster (NeMo-RL container, Slurm + pyxis)"))
    commands = [line.split("#")[0].split() for line in block]
    build = next(i for i, c in enumerate(commands) if c[:2] == ["bash", "containers/make_squashfs.sh"])
    assert "--build" in commands[build] and commands[:build].count(["docker", "login", "nvcr.io"]) == 1
    submits = [c for c in commands if c[0] == "sbatch"]
    assert len(submits) == 2
    for submit in submits:
        assert submit[1:5] == ["-A", "ACCOUNT", "-p", "PARTITION"], submit
        # the script's own header shows the same submission
        header = (Path(__file__).resolve().parents[2] / submit[5]).read_text()
        assert f"sbatch -A ACCOUNT -p PARTITION {submit[5]}" in header

"""How long a test waits on a subprocess, a Slurm job or a server before calling it hung.

A hang guard, never a timing premise: on a loaded 2-core machine (two xdist workers per core, Ray actors,
Slurm daemons, all at the same priority) a one-step `bapo-nemo train` of 14 CPU seconds took 100 s and
then hit a 120 s guard in a CI run. pytest-timeout's per-test limit (pyproject.toml) is the outer bound;
this one sits below it so that a hung wait fails with what it was waiting on."""

HANG_GUARD_S = 600

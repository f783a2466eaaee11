"""A fixed CPU probe, printed at the start and end of .ci/run, so that any figure of the run can be read
against the machine it ran on: the same pure-Python loop every time (one core), its CPU and wall seconds,
the cores this process may use and the load average."""

import os
import time

ITERATIONS = 10_000_000

wall, cpu = time.perf_counter(), time.process_time()
total = 0
for i in range(ITERATIONS):
    total += i * i % 7
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
print(f"== CPU probe: {ITERATIONS:,} iterations in {cpu:.2f} s CPU, {wall:.2f} s wall; "
      f"{len(os.sched_getaffinity(0))} cores; load average {load}")

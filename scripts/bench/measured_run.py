"""Run a command; print its wall seconds and peak RSS in KiB (used by the benchmarks).

Started as a small process of its own rather than from a benchmark: Linux charges a child
started by vfork + exec with the peak RSS of the process that started it, and a benchmark's own
grows past a gigabyte. The peak is the command's largest process (from wait4, which covers its
reaped children too), or with `--tree` the RSS of the command and every process it started,
summed every 20 ms (shared pages count once per process, so this overstates).

    python scripts/bench/measured_run.py [--tree] COMMAND...
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return [pid] + [p for child in children for p in tree(child)]


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGESIZE") // 1024
    except (OSError, IndexError, ValueError):
        return 0


def main() -> None:
    summed = sys.argv[1] == "--tree"
    command = sys.argv[2:] if summed else sys.argv[1:]
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=sys.stderr)
    if summed:
        peak = 0
        while proc.poll() is None:
            peak = max(peak, sum(rss_kib(p) for p in tree(proc.pid)))
            time.sleep(0.02)
        status = proc.returncode
    else:
        _, wait_status, usage = os.wait4(proc.pid, 0)
        peak, status = usage.ru_maxrss, os.waitstatus_to_exitcode(wait_status)
    print(time.perf_counter() - start, peak)
    sys.exit(status)


if __name__ == "__main__":
    main()

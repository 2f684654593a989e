"""Runs a command with its stderr through a pipe, as a log file under nohup, Slurm or a pod's log takes it, and writes
each line with the seconds since the start; last, the longest stretch without a line. What measures a cold start's
progress lines (`bcg capture JOB --warm --compile on`; docs/PERFORMANCE.md, issue 41; gpu.sh's `progress` leg).

    python benchmarks/stderr_times.py LOG CMD...
"""

from __future__ import annotations

import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    log, cmd = argv[0], argv[1:]
    t0 = last = time.perf_counter()
    gap, lines = 0.0, 0
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, bufsize=1)
        for line in proc.stderr:
            now = time.perf_counter()
            gap, last, lines = max(gap, now - last), now, lines + 1
            out.write(f"{now - t0:8.2f} {line}")
            out.flush()
        code = proc.wait()
        end = time.perf_counter()
        gap = max(gap, end - last)
        summary = (f"{lines} lines on stderr in {end - t0:.1f} s; the longest stretch without one: {gap:.1f} s; "
                   f"exit {code}")
        out.write(summary + "\n")
    print(summary)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

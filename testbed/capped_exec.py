"""Run a program with its address space capped, and report its own peak RSS:
``python capped_exec.py BYTES REPORT PROGRAM [ARGS...]``.

This small process forks the program (capped, then exec) and waits for it: the program's
``ru_maxrss`` is then its own. Capping in ``preexec_fn`` of the test process itself cannot measure
that: the child is (v)forked from the test worker, and the kernel keeps the worker's resident size
(1.3 GB after the heavy tests) as the child's peak. Writes the peak in KiB to REPORT, and ends as
the program ended (its exit code, or its signal)."""

from __future__ import annotations

import os
import resource
import signal
import sys
from pathlib import Path


def main() -> None:
    cap, report, program = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    pid = os.fork()
    if pid == 0:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        os.execvp(program[0], program)
    _, status, usage = os.wait4(pid, 0)
    report.write_text(str(usage.ru_maxrss))
    if os.WIFSIGNALED(status):  # end as it ended
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()

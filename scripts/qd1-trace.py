#!/usr/bin/env python3
"""Phases of QD1 requests in a tracefs trace (scripts/qd1-trace.sh).

Usage: qd1-trace.py TRACE BACKEND_COMM_PREFIX

A request goes: the client writes the kick eventfd (unless the backend
suppressed kicks while it polled), the backend is switched in, submits
(block_rq_issue), io_uring_enter returns, the disk completes
(block_rq_complete, in an interrupt), the backend is switched in again,
writes the call eventfd, and the client wakes. Each phase is printed with
its count and median in microseconds; a phase that did not happen (a kick
the backend's polling made unnecessary) is simply counted less often.
"""
import re
import statistics
import sys

LINE = re.compile(r"^\s*(.+?)-(\d+)\s+\[(\d+)\]\s+\S+\s+([\d.]+): (\w+): (.*)$")
WRITE, IO_URING_ENTER = "NR 1 ", "NR 426 "


def main(path, backend):
    phases = {k: [] for k in (
        "client kick write", "kick -> backend runs", "backend runs -> disk issue",
        "disk issue -> io_uring_enter returns", "disk", "disk irq -> backend runs",
        "backend runs -> call write", "call write", "requests")}
    kick_exit = kick_enter = issue = completed = call_enter = None
    woke = None  # (why, when) the backend was last switched in
    for line in open(path):
        m = LINE.match(line)
        if not m:
            continue
        comm, t, name, rest = m.group(1), float(m.group(4)) * 1e6, m.group(5), m.group(6)
        client = comm.startswith("ringblk-bench")
        ours = comm.startswith(backend)
        if client and name == "sys_enter" and rest.startswith(WRITE):
            kick_enter = t
        elif client and name == "sys_exit" and rest.startswith(WRITE) and kick_enter:
            phases["client kick write"].append(t - kick_enter)
            kick_exit, kick_enter = t, None
        elif name == "sched_switch" and f"next_comm={backend}" in rest:
            if completed is not None:
                phases["disk irq -> backend runs"].append(t - completed)
                woke, completed = ("completion", t), None
            elif kick_exit is not None and issue is None:
                phases["kick -> backend runs"].append(t - kick_exit)
                woke, kick_exit = ("kick", t), None
        elif name == "block_rq_issue" and ours:
            if woke and woke[0] == "kick":
                phases["backend runs -> disk issue"].append(t - woke[1])
            issue, kick_exit = t, None
            phases["requests"].append(0)
        elif ours and name == "sys_exit" and rest.startswith(IO_URING_ENTER) and issue:
            phases["disk issue -> io_uring_enter returns"].append(t - issue)
        elif name == "block_rq_complete" and issue is not None:
            phases["disk"].append(t - issue)
            issue, completed = None, t
        elif ours and name == "sys_enter" and rest.startswith(WRITE):
            call_enter = t
        elif ours and name == "sys_exit" and rest.startswith(WRITE) and call_enter:
            if woke and woke[0] == "completion":
                phases["backend runs -> call write"].append(call_enter - woke[1])
                phases["call write"].append(t - call_enter)
                woke = None
            call_enter = None
    n = len(phases.pop("requests"))
    kicks = len(phases["client kick write"])
    print(f"{n} requests traced, {kicks} kicks: {n - kicks} requests found by polling")
    for k, v in phases.items():
        med = f"{statistics.median(v):6.1f}" if v else "     -"
        print(f"  {k:40s} n={len(v):6d}  p50 {med} us")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

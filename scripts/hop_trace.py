#!/usr/bin/env python3
"""Where an O_DIRECT request's time goes, from a kernel trace.

    perf record -a -e io_uring:io_uring_submit_req -e io_uring:io_uring_complete \\
        -e block:block_rq_issue -e block:block_io_done -o hop.data -- sleep 2
    perf script -i hop.data | scripts/hop_trace.py

Pairs each io_uring request's submission with its completion (by the
request's address) and each block request's issue with its completion
(by device and sector), per command name (the ringblk worker thread,
qsd's, fio's), and prints, per command: requests per second, the mean
time in io_uring (submit -> complete) and in the device (block issue ->
complete, attributed to the command that issued it; an io_uring
request's block request is issued by its submitter), and the mean
number in flight in each (Little's law: rate x mean time). The client's
own mean latency (from the benchmark) minus the io_uring time is what
the vhost-user hop adds: the avail ring to the submission, and the
completion to the client seeing it on the used ring.
"""

import re
import sys
from collections import defaultdict

# `perf script` lines, and tracefs's `trace` lines (comm-pid, flags).
PERF = re.compile(r"^\s*(?P<comm>.+?)\s+(?P<pid>\d+)(?:/\d+)?\s+\[(?P<cpu>\d+)\]\s+(?P<ts>\d+\.\d+):\s+(?:\w+:)?(?P<event>\w+):\s*(?P<rest>.*)$")
TRACEFS = re.compile(r"^\s*(?P<comm>.+)-(?P<pid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+(?P<ts>\d+\.\d+):\s+(?P<event>\w+):\s*(?P<rest>.*)$")


def main():
    uring_start = {}
    uring = defaultdict(list)
    blk_start = {}
    blk = defaultdict(list)
    first = last = None
    for line in sys.stdin:
        m = TRACEFS.match(line) or PERF.match(line)
        if not m:
            continue
        ts = float(m["ts"])
        first = ts if first is None else first
        last = ts
        ev, rest, comm = m["event"], m["rest"], m["comm"].strip()
        if ev == "io_uring_submit_req":
            r = re.search(r"req (?:0x)?([0-9a-f]+)", rest)
            if r:
                uring_start[r[1]] = (ts, comm)
        elif ev == "io_uring_complete":
            r = re.search(r"req (?:0x)?([0-9a-f]+)", rest)
            if r and r[1] in uring_start:
                t0, c = uring_start.pop(r[1])
                uring[c].append(ts - t0)
        elif ev == "block_rq_issue":
            r = re.search(r"^(\d+,\d+) \S+ \d+ \(\) (\d+) \+ (\d+)", rest)
            if r:
                blk_start[(r[1], r[2])] = (ts, comm)
        elif ev in ("block_rq_complete", "block_io_done"):
            # blk-mq's batched completion skips block_rq_complete;
            # block_io_done (the I/O accounting's end) fires for each.
            r = re.search(r"^(\d+,\d+) \S+ (?:\d+ )?\(\S*\) (\d+) \+ (\d+)", rest)
            if r and (r[1], r[2]) in blk_start:
                t0, c = blk_start.pop((r[1], r[2]))
                blk[c].append(ts - t0)
    if first is None:
        sys.exit("no trace lines")
    span = last - first
    print(f"trace span {span:.3f} s")
    print("| command | io_uring req/s | mean in io_uring (us) | in flight | block req/s | mean in device (us) | in flight |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for comm in sorted(set(uring) | set(blk)):
        u, b = uring.get(comm, []), blk.get(comm, [])
        if len(u) + len(b) < 100:
            continue
        ur = len(u) / span
        um = sum(u) / len(u) * 1e6 if u else 0
        br = len(b) / span
        bm = sum(b) / len(b) * 1e6 if b else 0
        print(f"| {comm} | {ur:.0f} | {um:.1f} | {ur * um / 1e6:.1f} | {br:.0f} | {bm:.1f} | {br * bm / 1e6:.1f} |")


main()

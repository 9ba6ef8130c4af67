#!/usr/bin/env python3
"""Checks that imports between ringblk's top-level modules run one way.

    scripts/layers.py           check; exit 1 on an upward import
    scripts/layers.py --tree    also print each module and what it imports
    scripts/layers.py --src DIR check another tree's src/

Every `crate::X` a file under src/X/ (or src/X.rs) names, outside
comments, is an import of module X (the crate-root macros count as the
module that defines them). A module may import only modules of a lower
layer than its own; LAYERS below lists them bottom to top (modules on one
line are peers and do not import each other).
"""

import os
import re
import sys

LAYERS = [
    # Facts of the running host (its boot id).
    ["host"],
    # Encryption at rest: LUKS headers, AES-XTS, keys in locked memory
    # (the formats that carry it import it).
    ["crypto"],
    # Leaves: the split ring and typed requests; the image file; counters
    # and rate-limited logs; socket files; dirty bitmaps.
    ["virtio", "io", "metrics", "unix_socket", "bitmap"],
    # QoS (token buckets over virtio's Direction); the NBD server.
    ["qos", "nbd"],
    # The disk: where a guest offset lives (raw, qcow2 and its chain), the
    # format seam the engine core asks, the metadata thread, the one reader
    # off the data path.
    ["disk"],
    # The backup's point-in-time view (copy-before-write, served over NBD).
    ["backup"],
    # The device's runtime state, its bitmaps and its running backup
    # included.
    ["device"],
    # How: the engine core and the engines.
    ["engine"],
    # When: the queue workers.
    ["queue"],
    # vhost-user glue, the relay, SIGBUS containment.
    ["vhost"],
    # The HTTP endpoints (control API, metrics).
    ["api"],
    # Configuration, sockets, signals, the serve loop.
    ["daemon"],
    # The command line and its clients.
    ["cli"],
]
# Macros exported at the crate root, by the module that defines them.
ROOT_MACROS = {"warn_limited": "metrics", "info_limited": "metrics"}
# Re-exports at the crate root.
ROOT_ITEMS = {"cpu": "metrics"}

RANK = {m: i for i, layer in enumerate(LAYERS) for m in layer}
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
if "--src" in sys.argv:
    ROOT = sys.argv[sys.argv.index("--src") + 1]


def module_of(path):
    rel = os.path.relpath(path, ROOT)
    top = rel.split(os.sep)[0]
    return top[:-3] if top.endswith(".rs") else top


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def imports(text):
    found = set()
    # `use crate::{a::b, c}` names several at once.
    for group in re.finditer(r"crate::\{([^}]*(?:\{[^}]*\}[^}]*)*)\}", text):
        depth, name = 0, ""
        for ch in group.group(1) + ",":
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                if name.strip():
                    found.add(re.match(r"\s*(\w+)", name).group(1))
                name = ""
                continue
            if depth == 0:
                name += ch
    for m in re.finditer(r"crate::(\w+)", text):
        found.add(m.group(1))
    out = set()
    for name in found:
        name = ROOT_MACROS.get(name, ROOT_ITEMS.get(name, name))
        if name in RANK:
            out.add(name)
    return out


def main():
    deps = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(dirpath, f)
            mod = module_of(path)
            if mod in ("lib", "main"):
                continue
            if mod not in RANK:
                print(f"{os.path.relpath(path, ROOT)}: module {mod} is in no layer")
                deps.setdefault(mod, set())
                continue
            with open(path, encoding="utf-8") as fh:
                text = strip_comments(fh.read())
            for dep in imports(text) - {mod}:
                deps.setdefault(mod, set()).add((dep, os.path.relpath(path, ROOT)))
            deps.setdefault(mod, set())
    bad = []
    for mod, ds in sorted(deps.items(), key=lambda kv: (RANK.get(kv[0], 99), kv[0])):
        for dep, path in sorted(ds):
            if RANK.get(dep, 99) >= RANK.get(mod, -1):
                bad.append(f"src/{path}: {mod} imports {dep}, which is not below it")
    if "--tree" in sys.argv:
        for layer in reversed(LAYERS):
            for mod in layer:
                used = sorted({d for d, _ in deps.get(mod, ())}, key=lambda d: (RANK[d], d))
                print(f"{mod:<12} <- {', '.join(used) if used else '(nothing of ours)'}")
    for line in bad:
        print(line)
    unknown = [m for m in deps if m not in RANK]
    if bad or unknown:
        print(f"{len(bad)} upward import(s), {len(unknown)} module(s) in no layer")
        sys.exit(1)
    print("imports run one way: " + " <- ".join("/".join(l) for l in LAYERS))


if __name__ == "__main__":
    main()

"""Memory of a process tree on Linux, for the benches that run their subject in child processes."""
from __future__ import annotations

import os


def pss_bytes(pid: int) -> int:
    """Proportional set size of ``pid`` (shared pages split among their users), or its resident set
    where the kernel has no smaps_rollup; 0 for a process that is gone."""
    for name, key in (("smaps_rollup", "Pss:"), ("status", "VmRSS:")):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                for line in f:
                    if line.startswith(key):
                        return int(line.split()[1]) * 1024
        except OSError:
            continue
    return 0


def tree_pss(root: int) -> int:
    """Summed PSS (bytes) of ``root`` and all its descendants."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        total += pss_bytes(pid)
    return total

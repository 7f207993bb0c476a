"""This machine's memory, read without torch (the runtime's launcher and the profiler both ask)."""
from __future__ import annotations

import os

__all__ = ["available_host_bytes"]


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo, else the free physical pages."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

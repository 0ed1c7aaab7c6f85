"""The XLA:CPU client's thread pool, sized before the CPU backend starts so that it cannot deadlock:
launches and collective parts both hold pool threads while they wait, and with too few threads a
collective's last part never runs. Programs launch from two threads at most (the main thread and the
update's worker), so `reserve_threads` gives three threads per local device.
"""
from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

THREADS_PER_DEVICE = 3  # launches of two launching threads + one collective's parts


def local_cpu_devices(environ: MutableMapping[str, str]) -> int:
    """The CPU devices one process of `environ` gets (`--xla_force_host_platform_device_count`
    in `XLA_FLAGS`, else `JAX_NUM_CPU_DEVICES`, else 1)."""
    counts = re.findall(r"--xla_force_host_platform_device_count=(\d+)",
                        environ.get("XLA_FLAGS", ""))
    if counts:
        return int(counts[-1])
    return int(environ.get("JAX_NUM_CPU_DEVICES") or 1)


def reserve_threads(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Sets `PJRT_NPROC` in `environ` to `THREADS_PER_DEVICE` x the local CPU devices where there
    are several, that is more than the host's cores and `PJRT_NPROC` is unset; returns the value
    set, else None. Takes effect only before the CPU backend starts."""
    devices = local_cpu_devices(environ)
    if "PJRT_NPROC" in environ or devices < 2:
        return None
    threads = THREADS_PER_DEVICE * devices
    if threads <= len(os.sched_getaffinity(0)):
        return None
    environ["PJRT_NPROC"] = str(threads)
    return threads

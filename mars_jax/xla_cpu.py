"""The XLA:CPU client's thread pool, sized before the CPU backend starts so that it cannot
deadlock.

XLA:CPU launches programs and runs every device's part of a program on one pool of
max(`PJRT_NPROC` or the host's cores, local devices) threads, and both can hold a thread while
they wait: a launch once its device has 32 programs queued (a thread that dispatches
asynchronously runs that far ahead as soon as one program stalls), a part of a collective
program until the parts of every device have started. A thread that launches a program over D
devices waits until its D launches are done, and collectives run one at a time, so at most D
launches per launching thread plus the D parts of one collective hold threads at once. With
fewer threads the pool fills with them, the collective's last part never gets a thread and the
process stops at 0% CPU for good: on a 2-core host whose 2 local devices (each host's decode
engine, 2 processes x 2 devices) gave a pool of 2, one launch blocked behind the first part of
an engine collective whose second part was queued behind it. Programs launch from two threads
at most (the main thread, and the update's worker thread while the engine decodes), so
`reserve_threads` gives the pool three threads per local device.
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
    are several (one device runs no collective and launches on the calling thread), that is
    more than the host's cores and `PJRT_NPROC` is unset (module docstring); returns the value
    set, else None. Takes effect only before the CPU backend starts."""
    devices = local_cpu_devices(environ)
    if "PJRT_NPROC" in environ or devices < 2:
        return None
    threads = THREADS_PER_DEVICE * devices
    if threads <= len(os.sched_getaffinity(0)):
        return None
    environ["PJRT_NPROC"] = str(threads)
    return threads

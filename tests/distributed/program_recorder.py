"""Records what each host of a run of experiments/run.py runs on devices and agrees with the
other hosts, as lines of `{workdir}/programs{process}.jsonl` written when the run ends
(`distributed.exit_process` or an interpreter exit):

  {"global": [kind, name]}   in the order this host made them: a device program whose devices
                             span several processes (kind "program"), a host exchange round
                             (`distributed.HostGroup.gather`, kind "exchange") or the start of a
                             checkpoint save (kind "checkpoint", name its step);
  {"local": name, "devices": [[process, id], ...], "decode": bool}
                             once per distinct device program on this host's devices alone, with
                             whether the engine or the rollout scheduler launched it;
  {"decode_global": name}    a device program spanning several processes that the engine or
                             the rollout scheduler launched (none should).

Every jitted call runs through Python (jax's C++ dispatch fast path is off), so every execution
is seen; `install(on_launch)` also calls `on_launch(thread name, program name, ids of the
program's devices)` before each. Test helper: `install()` it in a wrapper of
experiments/run.py."""
import atexit
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import jax
from jax._src.interpreters import pxla

from mars_jax import distributed
from mars_jax.checkpoint import Checkpointer

_DECODE_CODE = ("mars_jax/sampling/", "mars_jax/rl/streaming.py")


def _launched_by_decode() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _DECODE_CODE):
            return True
        frame = frame.f_back
    return False


class _Recorder:
    def __init__(self):
        self.lock = threading.Lock()
        self.process: int | None = None  # known once the backend runs
        self.sequence: list[list[str]] = []
        self.local: dict[tuple, bool] = {}
        self.decode_global: list[str] = []

    def program(self, name: str, devices) -> None:
        decode = _launched_by_decode()
        with self.lock:
            if self.process is None:
                self.process = jax.process_index()
            if any(d.process_index != self.process for d in devices):
                self.sequence.append(["program", name])
                if decode:
                    self.decode_global.append(name)
            else:
                key = (name, tuple(sorted((d.process_index, d.id) for d in devices)))
                self.local[key] = self.local.get(key, False) or decode

    def exchange(self, name: str) -> None:
        with self.lock:
            self.sequence.append(["exchange", name])

    def checkpoint(self, step: int) -> None:
        with self.lock:
            self.sequence.append(["checkpoint", str(step)])

    def write(self, path: Path) -> None:
        with self.lock, open(path, "w") as f:
            for entry in self.sequence:
                f.write(json.dumps({"global": entry}) + "\n")
            for (name, devices), decode in sorted(self.local.items()):
                f.write(json.dumps({"local": name, "devices": devices, "decode": decode}) + "\n")
            for name in self.decode_global:
                f.write(json.dumps({"decode_global": name}) + "\n")


Launch = Callable[[str, str, frozenset[int]], None]


def install(on_launch: Launch | None = None) -> None:
    """Records from now on; writes `{--workdir}/programs{process}.jsonl` at exit."""
    recorder = _Recorder()
    build = pxla.UnloadedMeshExecutable.build_unsafe_call

    def recorded_build(self):
        call, name, devices = build(self), self.name, list(self.device_list)
        ids = frozenset(device.id for device in devices)

        def recorded_call(*args):  # not an ExecuteReplicated: jax then skips its fast path
            recorder.program(name, devices)
            if on_launch is not None:
                on_launch(threading.current_thread().name, name, ids)
            return call(*args)

        return recorded_call

    gather = distributed.HostGroup.gather

    def recorded_gather(self, value):
        if self.count > 1:
            recorder.exchange(self.name)
        return gather(self, value)

    save = Checkpointer.save

    def recorded_save(self, step, *args, **kwargs):
        recorder.checkpoint(step)
        return save(self, step, *args, **kwargs)

    workdir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--workdir="))

    def write() -> None:
        recorder.write(Path(workdir) / f"programs{recorder.process}.jsonl")

    exit_process = distributed.exit_process

    def recorded_exit(code, within_s=None):  # os._exit skips atexit
        write()
        exit_process(code, within_s)

    pxla.UnloadedMeshExecutable.build_unsafe_call = recorded_build
    distributed.HostGroup.gather = recorded_gather
    Checkpointer.save = recorded_save
    distributed.exit_process = recorded_exit
    atexit.register(write)

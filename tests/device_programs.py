"""Every device program this process launches, seen with the thread that launched it and the
devices it runs on. Test helper.

`install(on_launch)` calls `on_launch(thread name, program name, ids of this process's devices
the program runs on)` before each launch. It turns off jax's C++ dispatch fast paths (which run
a cached program without returning to Python), so that every launch passes through
`pxla.ExecuteReplicated`, the one Python call that runs a compiled program on its devices: jitted
functions, ahead-of-time compiled ones and eager operations alike. Install it before any program
runs."""
import threading
from collections.abc import Callable

from jax._src import pjit
from jax._src.interpreters import pxla

Launch = Callable[[str, str, frozenset[int]], None]


def install(on_launch: Launch) -> None:
    pjit._get_fastpath_data = lambda *args, **kwargs: None  # jitted calls: no C++ fast path
    pxla.MeshExecutable.create_cpp_call = lambda self, params: None  # nor for compiled ones
    execute = pxla.ExecuteReplicated.__call__

    def recorded(self, *args):
        on_launch(threading.current_thread().name, self.name,
                  frozenset(device.id for device in self._local_devices))
        return execute(self, *args)

    pxla.ExecuteReplicated.__call__ = recorded

"""Which jitted programs XLA compiles while a block runs (JAX's compile-duration events)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

from mars_jax.sampling.program_plan import PROGRAMS

ENGINE_PROGRAMS = frozenset(PROGRAMS)


@contextlib.contextmanager
def compiled_programs() -> Iterator[list[str]]:
    """Yields a list that collects the name of each program compiled inside the block."""
    names: list[str] = []

    def listen(event: str, seconds: float, fun_name: str = "", **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(fun_name.removeprefix("jit(").removesuffix(")"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)

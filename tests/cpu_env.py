"""The test session's XLA:CPU flags, for this process (conftest.py) and for the subprocesses
tests start."""
import os

from mars_jax import xla_cpu

# LLVM at -O0: the tests compile hundreds of small programs and run most of them briefly; from a
# cold compilation cache the compile-bound files take about a quarter less time that way
# (tests/rl/test_update.py + tests/rl/test_learning.py: 229 -> 172 s on 2 cores).
OPTIMIZATION = "--xla_backend_optimization_level=0"


def optimization_flag() -> str:
    """The optimisation level `XLA_FLAGS` chooses, else `OPTIMIZATION`."""
    chosen = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
              if flag.startswith("--xla_backend_optimization_level")]
    return chosen[-1] if chosen else OPTIMIZATION


def cpu_env(devices: int = 1, **extra: str) -> dict[str, str]:
    """This environment on `devices` fake CPU devices at this session's optimisation level, with
    the threads XLA:CPU needs for them (`xla_cpu.reserve_threads`)."""
    flags = optimization_flag() + (f" --xla_force_host_platform_device_count={devices}"
                                   if devices > 1 else "")
    env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}  # this process's own
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **extra)
    xla_cpu.reserve_threads(env)
    return env

"""The test session's XLA:CPU flags, for this process (conftest.py) and for the subprocesses
tests start."""
import os

# LLVM at -O0: the tests compile hundreds of small programs and run most of them briefly; from a
# cold compilation cache the compile-bound files take about a quarter less time that way
# (tests/rl/test_update.py + tests/rl/test_learning.py: 229 -> 172 s on 2 cores).
OPTIMIZATION = "--xla_backend_optimization_level=0"


def cpu_env(devices: int = 1, **extra: str) -> dict[str, str]:
    """This environment on `devices` fake CPU devices at the tests' optimisation level."""
    flags = OPTIMIZATION + (f" --xla_force_host_platform_device_count={devices}"
                            if devices > 1 else "")
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **extra)

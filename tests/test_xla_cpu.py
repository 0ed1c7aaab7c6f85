"""`mars_jax.xla_cpu`: the XLA:CPU client's thread pool is sized so that collective programs over
several local devices, launched back to back faster than they run, finish (with one thread per
device, as a 2-core host gives 2 devices, the same loop hangs at 0% CPU)."""
import subprocess
import sys

import numpy as np

from mars_jax import xla_cpu
from tests.cpu_env import cpu_env

# A program with a sum across 2 devices, launched 200 times without waiting for a result.
LOOP = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
x = jax.device_put(np.full((2, 32, 32), 0.01, np.float32), NamedSharding(mesh, P("d")))
step = jax.jit(lambda x: x + jnp.tanh(x @ x).sum(0, keepdims=True) / 64)
for _ in range(200):
    x = step(x)
print(float(x.sum()))
"""


def _reference() -> float:
    x = np.full((2, 32, 32), 0.01)
    for _ in range(200):
        x = x + np.tanh(x @ x).sum(0, keepdims=True) / 64
    return float(x.sum())


def test_collectives_launched_back_to_back_on_two_devices_finish():
    run = subprocess.run([sys.executable, "-c", LOOP], env=cpu_env(devices=2),
                         capture_output=True, text=True,
                         timeout=120)  # a deadlock fails here
    assert run.returncode == 0, run.stderr[-2000:]
    np.testing.assert_allclose(float(run.stdout.split()[-1]), _reference(), rtol=1e-4)


def test_reserve_threads_gives_three_threads_per_device_beyond_the_cores(monkeypatch):
    monkeypatch.setattr(xla_cpu.os, "sched_getaffinity", lambda pid: {0, 1})
    env = {"XLA_FLAGS": "--xla_backend_optimization_level=0 "
                        "--xla_force_host_platform_device_count=8"}
    assert xla_cpu.reserve_threads(env) == 24 and env["PJRT_NPROC"] == "24"
    env = {"JAX_NUM_CPU_DEVICES": "4"}
    assert xla_cpu.reserve_threads(env) == 12 and env["PJRT_NPROC"] == "12"
    chosen = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PJRT_NPROC": "5"}
    assert xla_cpu.reserve_threads(chosen) is None and chosen["PJRT_NPROC"] == "5"
    one = {}  # one device: no collective, the cores' pool
    assert xla_cpu.reserve_threads(one) is None and one == {}
    monkeypatch.setattr(xla_cpu.os, "sched_getaffinity", lambda pid: set(range(64)))
    many = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert xla_cpu.reserve_threads(many) is None and "PJRT_NPROC" not in many

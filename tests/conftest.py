"""Shared test setup: an 8-device fake CPU platform and small HF-made checkpoints.

XLA_FLAGS must be set before jax is imported anywhere, hence at the top of this file.
"""
import os

from mars_jax import xla_cpu  # imports no jax
from tests.cpu_env import optimization_flag  # imports no jax

_flags = os.environ.get("XLA_FLAGS", "")
_level = "" if optimization_flag() in _flags.split() else " " + optimization_flag()
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8" + _level).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
xla_cpu.reserve_threads()
# One persistent compilation cache for the whole test session, subprocesses included: programs
# compiled by one test (or a previous run) are loaded, not recompiled, by the next.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

# float32 matmuls in full on a GPU too (JAX's default there is TF32), as the HF-parity and
# exactness tests assume; in this process only: subprocesses keep each config's own.
jax.config.update("jax_default_matmul_precision", "float32")

from tests import hf_fixtures  # noqa: E402


@pytest.fixture(scope="session")
def hf_dense_dir(tmp_path_factory):
    """A tiny random HF Qwen3 (dense) checkpoint written by transformers."""
    return hf_fixtures.save_tiny_hf(tmp_path_factory.mktemp("hf_dense"), moe=False)


@pytest.fixture(scope="session")
def hf_moe_dir(tmp_path_factory):
    """A tiny random HF Qwen3-MoE checkpoint (one dense layer via mlp_only_layers)."""
    return hf_fixtures.save_tiny_hf(tmp_path_factory.mktemp("hf_moe"), moe=True)


def _data_dir_with(file_names, hint: str) -> str:
    """The data dir the loaders read by default; skips the test, naming `hint`, when it lacks
    any of `file_names`."""
    from mars_jax.data.paths import default_manual_dir
    try:
        directory = default_manual_dir()
    except FileNotFoundError:
        pytest.skip(f"no problem data dir: {hint}")
    missing = [name for name in file_names if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        pytest.skip(f"{directory} has no {', '.join(missing)}: {hint}")
    return directory


@pytest.fixture(scope="session")
def problem_data_dir() -> str:
    """The data dir the loaders read by default; skips the test, naming the command that writes
    it, when it lacks any problem set's file."""
    from mars_jax.data import fetch
    from mars_jax.data.paths import MANUAL_DIR_ENV
    problem_files = [f for name, files in fetch.dataset_files().items() if name != fetch.GRADER_CASES
                     for f in files]
    return _data_dir_with(problem_files, f"run `python -m mars_jax.data.fetch` (writes ../shared/data, "
                                         f"or ${MANUAL_DIR_ENV})")


@pytest.fixture(scope="session")
def data_mirror(problem_data_dir) -> str:
    """The data dir, when it holds every file of the project's data dir (grader_cases.jsonl
    too, which only `fetch --source` writes); else skips the test, naming that command."""
    from mars_jax.data import fetch
    return _data_dir_with(fetch.FILES, "copy the project's data dir with "
                                       "`python -m mars_jax.data.fetch --source=DIR`")


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    """Drops a test file's compiled programs when it ends (the next file loads what it needs
    from the persistent cache): each loaded XLA:CPU program holds memory maps, and one process
    that keeps a few hundred files' worth reaches the kernel's vm.max_map_count (65,530) and
    dies of a segmentation fault inside the next compile."""
    yield
    jax.clear_caches()


# The longest files (minutes each on 2 cores) go first, so that the two xdist workers of
# pytest.ini (a file at a time, in this order: `--dist=loadfile --no-loadscope-reorder`) finish
# together instead of one of them running a long subprocess test alone at the end.
LONGEST_FIRST = ("tests/distributed/test_stream_hosts.py", "tests/fault/test_gcs_workdir.py",
                 "tests/test_main_job.py", "tests/experiments/test_export_hf.py",
                 "tests/rl/test_overlap.py", "tests/rl/test_resume.py",
                 "tests/distributed/test_exchange_rounds.py",
                 "tests/distributed/test_agreed_restore.py",
                 "tests/distributed/test_host_loss.py",
                 "tests/fault/test_preemption.py", "tests/sampling/test_engine.py",
                 "tests/rl/test_update.py", "tests/sft/test_configs.py",
                 "tests/launch/test_aot_compile.py", "tests/sampling/test_sampler.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: the order within a file and among the rest is kept

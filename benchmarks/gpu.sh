#!/usr/bin/env bash
# One GPU (H100 / H200 with jax for CUDA installed), from the repository root:
#   bash benchmarks/gpu.sh                  (env: PARTS, PRESET, NUM_LAYERS, SLOTS, REQUESTS,
#                                            WHEELS, OUT)
# 0. the machine; packages it lacks installed from local wheels in $WHEELS (default .whl; no
#    network is assumed; the list is in benchmarks/NOTEBOOK.md, "One H100"), e.g. for Python 3.12:
#      pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
#        manylinux_2_28_x86_64 ... -d .whl grain array_record tensorflow-datasets ...
#    the machine's own jax, flax and optax are used (flax 0.12.8 fails on jax 0.11);
# 1. gpu check: exits 3 at once, saying why, when jax finds no GPU (no CUDA plugin, no driver);
# 2. smoke: a tiny model generates on the GPU (exits 1 early if not, so a retry has time);
# then the PARTS, in the order given (default: `lease`, the issue-64 measurements; its limit,
# 330 s, and the two steps' 60 s each end it within 8 minutes; not yet run on a GPU):
#   lease     benchmarks/gpu_lease.py: one table at $PRESET shapes with $NUM_LAYERS layers
#             (default 4), bf16: update (loss + grads + AdamW, 2 x 4,096 tokens) and prefill
#             MFU with the MoE's `sorted` dispatch and the Mosaic GPU grouped matmul (`mgpu`);
#             the paged engine's decode tokens/s per GPU, slots held and HBM bandwidth share
#             ($SLOTS slots, $REQUESTS long-tailed requests); rows print as they finish, a
#             row that fails says why and the next runs;
#   tests     the GPU-capable tests: engine exactness and HF parity (torch reference on CPU);
#   moe       benchmarks/gpu.py moe: one MoE block, forward, per dispatch backend;
#   pipeline  benchmarks/pipeline.py (issue 16): pipeline vs sequential, its defaults (bench
#             preset) with decode spans from 512 (fewer decode programs to compile) and the
#             engine's programs compiled ahead on a thread pool (`--precompile`);
#   engine    benchmarks/gpu.py engine: reserved slots vs a paged cache of the same KV memory
#             over 4x the slots vs generate: $PRESET shapes, $NUM_LAYERS layers, bf16, $SLOTS
#             slots, $REQUESTS long-tailed requests, one timed call each.
# (benchmarks/gpu.py forward + train, measured on the first H200: `--parts forward,train`.)
# Every part has its own time limit; the output is also written to $OUT/gpu.log. Through the
# device tool the working tree travels (64 MiB at most): move experiments/results/study/runs and
# .../eval (committed checkpoints, ~100 MB) out of the tree for the call, and carry .whl.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}  # cpu: hf_io reads checkpoints there
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
# Compiled programs kept on disk: a second call on the same warm machine (the device tool keeps
# ignored paths between calls) loads what the first compiled instead of compiling it again.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0.5}
PRESET=${PRESET:-qwen3_30b_a3b}
NUM_LAYERS=${NUM_LAYERS:-4}
SLOTS=${SLOTS:-256}
REQUESTS=${REQUESTS:-512}
WHEELS=${WHEELS:-.whl}
PARTS=${PARTS:-lease}
step() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }
rm -rf /tmp/site
install() {  # wheels into /tmp/site (first on the path), no dependencies resolved
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$@" && export PYTHONPATH=/tmp/site:$PYTHONPATH
}
smoke() {
  timeout 60 python - <<'PY'
import jax, flax, optax
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__,
      jax.devices())
import benchmarks.pipeline  # noqa: F401  (imports everything the pipeline step needs)
from mars_jax.models import create_model, get_preset
from mars_jax.sampling import Engine
model = create_model(get_preset("tiny"), seed=0)
engine = Engine(model, num_slots=4, max_length=64, chunk_steps=8)
engine.submit([1, 2, 3], max_new_tokens=8, temperature=0.0)
print("smoke ok:", engine.run())
PY
}

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
lscpu | grep -m1 "Model name" || true
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  install "$WHEELS"/*.whl || echo "installing $WHEELS failed"
fi

step "gpu check"
command -v nvidia-smi > /dev/null || echo "no nvidia-smi on this machine"
timeout 60 python - <<'PY' || { echo "NO GPU: jax finds no CUDA device (see above); install \
jax[cuda12] (or cuda13) with a driver that matches, or run on a machine with a GPU"; exit 3; }
import jax
gpus = [d for d in jax.devices() if d.platform == "gpu"]
assert gpus, f"jax {jax.__version__} sees only {jax.devices()}"
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: F401  (the mgpu dispatch)
print("gpus:", gpus)
PY

step "smoke"
smoke || { echo "SMOKE FAILED"; exit 1; }

run_part() {
  case "$1" in
    lease)
      step "lease: update and prefill MFU per MoE dispatch, paged decode ($PRESET, $NUM_LAYERS)"
      timeout 330 python benchmarks/gpu_lease.py --preset "$PRESET" --num-layers "$NUM_LAYERS" \
        --slots "$SLOTS" --requests "$REQUESTS" || echo "lease: failed or timed out (rc $?)" ;;
    tests)  # ~160 s on the H100 with its 2 xdist workers
      step "tests (engine exactness, HF parity)"
      # pytest.ini runs 2 xdist workers: each may take 0.4 of the GPU's memory, not 0.92.
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 timeout 200 python -m pytest -q -p no:cacheprovider \
        tests/sampling/test_engine.py tests/models/test_qwen3_parity.py \
        -k "not mesh and not slow" || echo "TESTS FAILED OR TIMED OUT (rc $?)" ;;
    moe)  # ~35 s
      step "one MoE block per dispatch backend ($PRESET shapes, bf16)"
      timeout 60 python benchmarks/gpu.py --preset "$PRESET" --parts moe \
        || echo "moe: failed or timed out (rc $?)" ;;
    pipeline)  # lazily compiled, the sequential mode's first update took 204 s on the H100
      step "agentic pipeline vs sequential (benchmarks/pipeline.py: defaults, spans from 512)"
      timeout 480 python -m benchmarks.pipeline --min_span=512 --precompile \
        || echo "pipeline: failed or timed out (rc $?)" ;;
    engine)
      step "engine: reserved vs paged vs generate ($PRESET shapes, $NUM_LAYERS layers, bf16)"
      timeout 240 python benchmarks/gpu.py --preset "$PRESET" --num-layers "$NUM_LAYERS" \
        --parts engine --slots "$SLOTS" --paged-slots $((4 * SLOTS)) --requests "$REQUESTS" \
        --engines engine,paged,generate --repeats 1 || echo "engine: failed or timed out (rc $?)" ;;
    *) echo "unknown part '$1' in PARTS (lease, tests, moe, pipeline, engine)"; exit 2 ;;
  esac
}
for part in ${PARTS//,/ }; do run_part "$part"; done

step "done"

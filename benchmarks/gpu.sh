#!/usr/bin/env bash
# One GPU (an H200 with jax for CUDA installed), at most ~8 minutes, run from the repository root:
#   bash benchmarks/gpu.sh            (env: PRESET, NUM_LAYERS, SLOTS, REQUESTS, WHEELS, OUT)
# 1. checks the machine and installs what it lacks from local wheels (no network is assumed:
#    put wheels in $WHEELS, default shared/wheels, e.g. `pip download flax optax orbax-checkpoint
#    ml_collections transformers safetensors tqdm pytest -d shared/wheels`);
# 2. the GPU-capable tests: HF parity, sampler and engine exactness (on the GPU; the HF
#    reference runs in torch on the CPU; 8-device mesh tests deselected: one device);
# 3. benchmarks/gpu.py in bfloat16: forward, train step, decode, engine vs generate at 256 slots
#    (tokens/s, MFU against the bf16 peak, achieved HBM bandwidth).
# Every step has its own time limit so the whole script ends within ~8 minutes; the output is
# also written to $OUT/gpu.log (default ./gpu_results) for benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_PLATFORMS=cuda
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
PRESET=${PRESET:-qwen3_30b_a3b}
NUM_LAYERS=${NUM_LAYERS:-12}
SLOTS=${SLOTS:-256}
REQUESTS=${REQUESTS:-512}
WHEELS=${WHEELS:-shared/wheels}
step() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
lscpu | grep -m1 "Model name" || true
missing=$(python - <<'PY'
import importlib.util
mods = {"flax": "flax", "optax": "optax", "orbax.checkpoint": "orbax-checkpoint",
        "ml_collections": "ml_collections", "transformers": "transformers",
        "safetensors": "safetensors", "tqdm": "tqdm", "pytest": "pytest", "torch": "torch"}
print(" ".join(p for m, p in mods.items() if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "missing: $missing"
  if [ -d "$WHEELS" ]; then
    timeout 60 pip install -q --no-index --find-links "$WHEELS" $missing || echo "install failed"
  else
    echo "no wheels in $WHEELS: steps needing them will fail"
  fi
fi
python -c "import jax; print('jax', jax.__version__, jax.devices())" || { echo "no jax GPU"; exit 1; }

step "tests (GPU-capable subset)"
timeout 120 python -m pytest -q -x -p no:cacheprovider \
  tests/models/test_qwen3_parity.py tests/sampling/test_sampler.py tests/sampling/test_engine.py \
  -k "not mesh" || echo "TESTS FAILED OR TIMED OUT (rc $?)"

step "forward + train step ($PRESET, $NUM_LAYERS layers, bf16)"
timeout 110 python benchmarks/gpu.py --preset "$PRESET" --num-layers "$NUM_LAYERS" \
  --parts forward,train || echo "forward/train: failed or timed out (rc $?)"

step "decode ($PRESET, $NUM_LAYERS layers, bf16)"
timeout 80 python benchmarks/gpu.py --preset "$PRESET" --num-layers "$NUM_LAYERS" \
  --parts decode || echo "decode: failed or timed out (rc $?)"

step "engine vs generate, $SLOTS slots, $REQUESTS long-tailed requests"
timeout 100 python benchmarks/gpu.py --preset "$PRESET" --num-layers "$NUM_LAYERS" \
  --parts engine --slots "$SLOTS" --requests "$REQUESTS" || echo "engine: failed or timed out (rc $?)"
step "done"

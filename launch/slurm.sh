#!/usr/bin/env bash
# A multi-node GPU job on Slurm: one task per node, each running experiments/run.py under the
# restart loop, the coordinator on the first node (launch/slurm.py derives it).
#
#   sbatch --nodes=2 launch/slurm.sh --config=experiments/configs/marsrl_qwen3_30b_a3b_gpu.py \
#       --workdir=/shared/marsrl_30b
#
# Run from the repository on a file system every node sees (sbatch starts in the submit dir), with
# MARS_JAX_PYTHON pointing at the project's environment (default: .venv/bin/python, made by
# `python3.11 -m venv .venv && .venv/bin/pip install -c constraints.txt -e ".[cuda12]"`).
# MARS_JAX_DRY_RUN=1 prints each task's command instead of running it.
#SBATCH --job-name=marsrl
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=7-00:00:00
set -euo pipefail
PYTHON="${MARS_JAX_PYTHON:-.venv/bin/python}"
DRY_RUN=()
if [[ "${MARS_JAX_DRY_RUN:-0}" == 1 ]]; then DRY_RUN=(--dry_run); fi
srun --ntasks-per-node=1 "$PYTHON" launch/slurm.py --port="${MARS_JAX_PORT:-12355}" \
    ${DRY_RUN[@]+"${DRY_RUN[@]}"} -- "$@"

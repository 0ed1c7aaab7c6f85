#!/usr/bin/env bash
# The whole toy study of experiments/RESULTS.md in one command, resumable:
#
#   mkdir -p /tmp/mars_study && nohup nice -n 19 bash experiments/study.sh /tmp/mars_study \
#     > /tmp/mars_study/study.log 2>&1 &
#
# warm start (the committed experiments/results/study/sft, copied to $ROOT/sft; with
# RETRAIN_SFT=1, when $ROOT/sft has no model yet, study.py:sft trains it again from
# experiments/results/study/warm_start) -> its
# evaluation (the base row, in $OUT/base) -> RL runs in this order: marsrl_seed0,
# marsrl_s_seed0, marsrl_seed1, marsrl_s_seed1 (the two-seed rows first), marsrl_vc_seed0, then
# MarsRL with the two selection policies other than the config's (seed 0) -> experiments/report.py
# (evaluates every model, writes the tables and plots to $OUT, default $ROOT/report; then
# `report.py --root=$ROOT --skip_eval --out=experiments/results/study` for the repository's copy).
# Everything runs under `nice -n 19`. Re-running it skips runs finished with the same extra
# arguments (a `done` file in the run directory holds them) and resumes an interrupted one, or one
# finished with other arguments, from its newest checkpoint, or from the copy committed under
# experiments/results/study/runs/<run> when $ROOT has none; the report's evaluation resumes from
# its records. Extra arguments go to every RL run (e.g. --config.total_steps=3).
set -euo pipefail
ROOT=${1:-/tmp/mars_study}
shift || true
OUT=${OUT:-$ROOT/report}
CONFIG=experiments/configs/study.py
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
mkdir -p "$ROOT"
run() { echo "== $(date -u +%FT%TZ) $*"; nice -n 19 python "$@"; }

if [[ ! -f $ROOT/sft/model/config.json ]]; then  # the sft job does not resume: it starts over
  if [[ ${RETRAIN_SFT:-0} == 1 ]]; then
    run experiments/run.py --config=$CONFIG:sft --workdir="$ROOT/sft"
  else
    rm -rf "$ROOT/sft.tmp" && cp -r experiments/results/study/sft "$ROOT/sft.tmp"
    rm -rf "$ROOT/sft" && mv "$ROOT/sft.tmp" "$ROOT/sft"  # whole or not at all
  fi
fi

# Evaluations committed under experiments/results/study/eval (the base; runs committed under
# experiments/results/study/runs, of their committed checkpoint) are reused, not redone.
mkdir -p "$ROOT/eval" && cp -rn experiments/results/study/eval/. "$ROOT/eval/"

# The warm start's row first (issue 17: report it before any RL): the report evaluates only the
# base while no RL run has started.
if [[ ! -f $ROOT/eval/base/eval/summary.json ]] && ! compgen -G "$ROOT/marsrl*" > /dev/null; then
  run experiments/report.py --root="$ROOT" --config_module=study --out="$OUT/base"
fi

default_selection=$(python -c "import sys; sys.path.insert(0, 'experiments/configs'); \
import study; print(study.get_config('marsrl').rollout.selection)")
runs=(marsrl:0: marsrl_s:0: marsrl:1: marsrl_s:1: marsrl_vc:0:)
for sel in adaptive balanced random; do
  [[ $sel == "$default_selection" ]] || runs+=("marsrl:0:$sel")
done
for spec in "${runs[@]}"; do
  IFS=: read -r variant seed sel <<< "$spec"
  name=${variant}${sel:+_$sel}_seed$seed
  [[ -f $ROOT/$name/done && $(cat "$ROOT/$name/done") == "$*" ]] && {
    echo "== $name: done, skipped"; continue; }
  saved=experiments/results/study/runs/$name  # a run committed part-way, resumed from there
  if [[ ! -d $ROOT/$name && -d $saved ]]; then
    mkdir -p "$ROOT/$name" && cp -r "$saved/." "$ROOT/$name/"
  fi
  run experiments/run.py --config=$CONFIG:"$variant" --workdir="$ROOT/$name" \
    --config.seed="$seed" --config.model.checkpoint="$ROOT/sft/model" \
    ${sel:+--config.rollout.selection=$sel} "$@"
  echo "$*" > "$ROOT/$name/done"
done

run experiments/report.py --root="$ROOT" --config_module=study --out="$OUT"
echo "== $(date -u +%FT%TZ) study finished: $OUT/tables.md"

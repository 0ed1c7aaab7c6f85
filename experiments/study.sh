#!/usr/bin/env bash
# A toy study of experiments/RESULTS.md in one command, resumable:
#
#   mkdir -p /tmp/mars_study_weak && nohup nice -n 19 bash experiments/study.sh \
#     /tmp/mars_study_weak weak > /tmp/mars_study_weak/study.log 2>&1 &      # Study 7
#   bash experiments/study.sh /tmp/mars_study strong                        # Study 6
#
# The warm start: the committed <results>/sft (model/ and its run's metrics), copied to $ROOT/sft.
# With RETRAIN_SFT=1 (and no $ROOT/sft/model yet) it is trained again instead:
#   weak (experiments/configs/study_weak.py, the paper's regime: a weak critic at the start):
#     Study 5's SFT model (extracted from the git history) -> study_weak.py:sft, its first
#     WEAK_STEP of 750 steps (probed every 50) -> its step-WEAK_STEP model;
#   strong (experiments/configs/study.py): study.py:sft from experiments/results/study/warm_start.
#   A retrained model is another model on another CPU (float rounding): Study 7's amendment.
# Then the warm start's evaluation (the base row, $OUT/base) -> RL runs in this order:
# marsrl_seed0, marsrl_s_seed0, marsrl_s_seed1, marsrl_seed1 (the two-seed rows first),
# marsrl_vc_seed0 (strong: then MarsRL with the two selection policies other than the config's,
# seed 0), each evaluated by experiments/report.py as soon as it ends (tables and plots of the
# rows so far in $OUT, default $ROOT/report) and its metrics, `done` file and evaluation records
# copied to <results>/runs/<run> and <results>/eval/<run> for git (its checkpoints stay out).
# The repository's tables come from `python experiments/report.py --root=$ROOT
# --config_module=<study_weak | study> --skip_eval --out=<dir>`:
# experiments/results/study_weak/report (Study 7) and
# experiments/results/study/four_rows, .../selection (Study 6).
# Everything runs under `nice -n 19`. Re-running it skips runs finished with the same extra
# arguments (a `done` file in the run directory holds them) and resumes an interrupted one, or one
# finished with other arguments, from its newest checkpoint, or from the copy committed under
# <results>/runs/<run> when $ROOT has none (a finished run's copy holds its `done` file: skipped);
# the report's evaluation resumes from its records.
# Extra arguments go to every RL run (e.g. --config.total_steps=3).
set -euo pipefail
ROOT=${1:-/tmp/mars_study_weak}
STUDY=${2:-weak}
shift 2 || shift $# || true
OUT=${OUT:-$ROOT/report}
cd "$(dirname "$0")/.."
case $STUDY in
  weak) MODULE=study_weak ;;
  strong) MODULE=study ;;
  *) echo "study.sh: unknown study '$STUDY' (weak | strong)" >&2; exit 2 ;;
esac
CONFIG=experiments/configs/$MODULE.py
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
setting() { python -c "import sys; sys.path.insert(0, 'experiments/configs'); import $MODULE; \
print($MODULE.$1)"; }
RESULTS=$(setting RESULTS)
mkdir -p "$ROOT"
run() { echo "== $(date -u +%FT%TZ) $*"; nice -n 19 python "$@"; }

if [[ ! -f $ROOT/sft/model/config.json ]]; then  # the sft job does not resume: it starts over
  rm -rf "$ROOT/sft.tmp"
  if [[ ${RETRAIN_SFT:-0} != 1 ]]; then
    cp -r "$RESULTS/sft" "$ROOT/sft.tmp"
  elif [[ $STUDY == weak ]]; then
    p8=$(setting P8_PATH) commit=$(setting P8_COMMIT) step=$(setting WEAK_STEP)
    mkdir -p "$ROOT/p8" "$ROOT/sft.tmp"
    for f in config.json model.safetensors; do git show "$commit:$p8/$f" > "$ROOT/p8/$f"; done
    [[ -f $ROOT/sft_run/model_step$step/config.json ]] ||
      run experiments/run.py --config=$CONFIG:sft --workdir="$ROOT/sft_run" \
        --config.model.checkpoint="$ROOT/p8" --config.sft.stop_at="$step"
    cp -r "$ROOT/sft_run/model_step$step" "$ROOT/sft.tmp/model"
    cp "$ROOT/sft_run/metrics.jsonl" "$ROOT/sft.tmp/"
  else
    run experiments/run.py --config=$CONFIG:sft --workdir="$ROOT/sft.tmp"
  fi
  rm -rf "$ROOT/sft" && mv "$ROOT/sft.tmp" "$ROOT/sft"  # whole or not at all
fi

# Evaluations committed under <results>/eval (the base, and each finished run's, beside its
# metrics and `done` under <results>/runs) are reused, not redone.
mkdir -p "$ROOT/eval"
[[ -d $RESULTS/eval ]] && cp -rn "$RESULTS/eval/." "$ROOT/eval/"

# The warm start's row first (issue 17: report it before any RL): the report evaluates only the
# base while no RL run has started.
if [[ ! -f $ROOT/eval/base/eval/summary.json ]] && ! compgen -G "$ROOT/marsrl*" > /dev/null; then
  run experiments/report.py --root="$ROOT" --config_module=$MODULE --out="$OUT/base"
fi

# RUNS (space-separated variant:seed:selection specs) replaces the list, e.g. to run one row beside
# another study.sh on the same root: RUNS="marsrl:1:" bash experiments/study.sh ...
read -ra runs <<< "${RUNS:-marsrl:0: marsrl_s:0: marsrl_s:1: marsrl:1: marsrl_vc:0:}"
if [[ $STUDY == strong && -z ${RUNS:-} ]]; then
  default_selection=$(python -c "import sys; sys.path.insert(0, 'experiments/configs'); \
import study; print(study.get_config('marsrl').rollout.selection)")
  for sel in adaptive balanced random; do
    [[ $sel == "$default_selection" ]] || runs+=("marsrl:0:$sel")
  done
fi
for spec in "${runs[@]}"; do
  IFS=: read -r variant seed sel <<< "$spec"
  name=${variant}${sel:+_$sel}_seed$seed
  saved=$RESULTS/runs/$name  # a run committed part-way or finished, resumed from there
  if [[ ! -d $ROOT/$name && -d $saved ]]; then
    mkdir -p "$ROOT/$name" && cp -r "$saved/." "$ROOT/$name/"
  fi
  if [[ -f $ROOT/$name/done && $(cat "$ROOT/$name/done") == "$*" ]]; then
    echo "== $name: done, skipped"
  else
    run experiments/run.py --config=$CONFIG:"$variant" --workdir="$ROOT/$name" \
      --config.seed="$seed" --config.model.checkpoint="$ROOT/sft/model" \
      ${sel:+--config.rollout.selection=$sel} "$@"
    echo "$*" > "$ROOT/$name/done"
  fi
  # Evaluated at once (complete records are not redone), and its text outputs kept in <results>
  # for git: a later session, on a new machine, has neither this run's checkpoints nor its model.
  run experiments/report.py --root="$ROOT" --config_module=$MODULE --out="$OUT"
  mkdir -p "$saved" "$RESULTS/eval/$name/eval"
  cp "$ROOT/$name/"{metrics.jsonl,done} "$saved/"
  cp "$ROOT/eval/$name/eval/"{records.jsonl,summary.json} "$RESULTS/eval/$name/eval/"
done
echo "== $(date -u +%FT%TZ) study finished: $OUT/tables.md"

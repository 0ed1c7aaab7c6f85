"""experiments/run.py with each rollout's reward replaced by the parity of its index in its group
(uid '.../s{stage}/{index}'), so a random model's groups have reward variance and its updates
move the parameters. Test helper."""
import runpy
import sys
from pathlib import Path

from mars_jax.rl.rollout import AgenticRollouts

_grade = AgenticRollouts._grade


def _parity_grade(self, finished):
    _grade(self, finished)
    for r in finished:
        r.reward = float(int(r.uid.rsplit("/", 1)[1]) % 2)


AgenticRollouts._grade = _parity_grade
run = Path(__file__).resolve().parents[2] / "experiments/run.py"
sys.argv[0] = str(run)
runpy.run_path(str(run), run_name="__main__")

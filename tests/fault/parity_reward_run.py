"""experiments/run.py with each rollout's reward replaced by the parity of its index in its group
(uid '.../s{stage}/{index}'), so a random model's groups have reward variance and its updates
move the parameters. Test helper: run it as a script, or `install()` it in another wrapper."""
import runpy
import sys
from pathlib import Path

from mars_jax.rl.rollout import AgenticRollouts

RUN = Path(__file__).resolve().parents[2] / "experiments/run.py"


def install() -> None:
    """Rewards by index parity from now on (after the real grading, which still runs)."""
    grade = AgenticRollouts._grade

    def parity_grade(self, finished):
        grade(self, finished)
        for r in finished:
            r.reward = float(int(r.uid.rsplit("/", 1)[1]) % 2)

    AgenticRollouts._grade = parity_grade


def run() -> None:
    """experiments/run.py with this process's arguments."""
    sys.argv[0] = str(RUN)
    runpy.run_path(str(RUN), run_name="__main__")


if __name__ == "__main__":
    install()
    run()

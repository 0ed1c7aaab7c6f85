"""experiments/run.py with parity rewards (`parity_reward_run.py`) and one step made slow, for
preemption tests. Test helper: run it as a script.

  SLOW_COLLECT=v  the streaming `collect` at policy version v sleeps SLOW_ROUND_S (default 5)
                  seconds after each decode round, and returns no sooner than 60 s after it began;
  SLOW_UPDATE=k   each micro-batch of the optimizer updates from the run's k-th on (the train
                  state's update count) sleeps SLOW_UPDATE_S (default 8) seconds after it ran.

Each writes `{workdir}/slow_collect` or `{workdir}/slow_update` when its first slow unit is done,
so that a test can send SIGTERM in the middle of the slow part.
"""
import os
import sys
import time

import jax

from mars_jax import storage
from mars_jax.rl import learner, trainer
from mars_jax.rl.streaming import StreamingRollouts
from tests.fault import parity_reward_run

STEP_SECONDS = 60  # what a slow collect lasts at least


def _marker(name: str) -> None:
    workdir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--workdir="))
    (storage.path(workdir) / name).write_text("")  # a local or gs:// workdir


def install() -> None:
    if "SLOW_COLLECT" in os.environ:
        slow_version, pause = int(os.environ["SLOW_COLLECT"]), float(
            os.environ.get("SLOW_ROUND_S", 5))
        decode_round, collect = StreamingRollouts._round, StreamingRollouts.collect

        def slow_round(self, version, until):
            decoded = decode_round(self, version, until)
            if version == slow_version:
                _marker("slow_collect")
                time.sleep(pause)
            return decoded

        def slow_collect(self, version):
            start = time.monotonic()
            batch = collect(self, version)
            if version == slow_version:
                time.sleep(max(0.0, STEP_SECONDS - (time.monotonic() - start)))
            return batch

        StreamingRollouts._round, StreamingRollouts.collect = slow_round, slow_collect
    if "SLOW_UPDATE" in os.environ:
        first, pause = int(os.environ["SLOW_UPDATE"]), float(os.environ.get("SLOW_UPDATE_S", 8))
        # What train_mini_batches calls for each micro-batch, and to end each optimizer update.
        micro_batch, apply = learner._MICRO_BATCH, learner._APPLY
        update = trainer.train_mini_batches
        updates = [0]  # the train state's update count

        def counted_update(state, *args, **kwargs):
            updates[0] = int(state.step)
            return update(state, *args, **kwargs)

        def counted_apply(*args, **kwargs):
            result = apply(*args, **kwargs)
            updates[0] += 1
            return result

        def slow_micro_batch(*args, **kwargs):
            result = jax.block_until_ready(micro_batch(*args, **kwargs))
            if updates[0] >= first:
                _marker("slow_update")
                time.sleep(pause)
            return result

        trainer.train_mini_batches, learner._APPLY = counted_update, counted_apply
        learner._MICRO_BATCH = slow_micro_batch


if __name__ == "__main__":
    parity_reward_run.install()
    install()
    parity_reward_run.run()

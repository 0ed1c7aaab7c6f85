"""The held-out probe's typed settings (`ProbeSettings`) from a run's `ml_collections` config."""
from __future__ import annotations

from ml_collections import ConfigDict

from mars_jax.sampling.config import eval_engine_settings
from mars_jax.sft.probe import ProbeSettings


def probe_settings(config: ConfigDict, slots: int) -> ProbeSettings:
    """The held-out probe at the `eval` section's sampling settings and budgets, on
    `sampling.config.eval_engine_settings(config, slots)`."""
    e = config.eval
    return ProbeSettings(temperature=e.temperature, top_p=e.top_p, seed=config.seed,
                         max_new_tokens=dict(e.max_new_tokens), style=config.rollout.prompt_style,
                         engine=eval_engine_settings(config, slots))

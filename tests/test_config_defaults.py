"""The typed settings' own defaults against experiments/configs/common.py's, the documented ones:
each settings class built from `base_config()` by `mars_jax.rl.config` equals that class built
with its own defaults (the fields without one taken from the built object), so that the two
layers cannot drift apart."""
import dataclasses
import inspect

import pytest

from experiments.configs.common import base_config
from mars_jax.optimizer import make_optimizer
from mars_jax.rl import config as rl_config
from mars_jax.rl.learner import LearnerConfig
from mars_jax.rl.losses import LossConfig
from mars_jax.rl.rollout import RolloutConfig
from mars_jax.rl.streaming import StreamSettings
from mars_jax.rl.update import UpdateConfig
from mars_jax.sft.probe import ProbeSettings


def _has_default(field: dataclasses.Field) -> bool:
    return (field.default is not dataclasses.MISSING
            or field.default_factory is not dataclasses.MISSING)


@pytest.mark.parametrize("build, cls", [
    (rl_config.rollout_config, RolloutConfig),
    (rl_config.loss_config, LossConfig),
    (rl_config.update_program_config, UpdateConfig),
    (rl_config.learner_config, LearnerConfig),
], ids=["rollout", "loss", "update", "learner"])
def test_a_settings_class_defaults_to_common_py(build, cls):
    built = build(base_config())
    fields = dataclasses.fields(cls)
    assert any(_has_default(f) for f in fields)
    defaulted = cls(**{f.name: getattr(built, f.name) for f in fields if not _has_default(f)})
    differ = {f.name: (getattr(built, f.name), getattr(defaulted, f.name))
              for f in fields if getattr(built, f.name) != getattr(defaulted, f.name)}
    assert not differ, f"(common.py, {cls.__name__}'s default) differ: {differ}"


@pytest.mark.parametrize("cls", [StreamSettings, ProbeSettings, rl_config.RunSettings,
                                 rl_config.TrainSettings])
def test_the_other_settings_have_no_default_of_their_own(cls):
    assert [f.name for f in dataclasses.fields(cls) if _has_default(f)] == []


def test_the_optimizer_defaults_to_common_py():
    optimizer = base_config().optimizer
    defaults = {name: p.default for name, p in inspect.signature(make_optimizer).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert defaults.keys() <= set(optimizer.keys())
    assert defaults == {name: optimizer[name] for name in defaults}

"""config_diff: a resumed run's config against the one its checkpoint was saved with."""
import pytest

from experiments.configs import smoke
from mars_jax import config_diff
from mars_jax.errors import ConfigError


def _saved(**changes):
    """smoke's config as a checkpoint holds it, with dotted `changes` applied."""
    saved = config_diff.record(smoke.get_config())
    for field, value in changes.items():
        *sections, name = field.split("__")
        node = saved
        for part in sections:
            node = node[part]
        node[name] = value
    return saved


def test_the_record_is_plain_json_of_every_field():
    saved = config_diff.record(smoke.get_config())
    assert saved["rollout"]["group_size"] == smoke.get_config().rollout.group_size
    assert saved["data"]["arith"]["num_ops"] == list(smoke.get_config().data.arith.num_ops)


def test_the_same_config_resumes_silently(capsys):
    config_diff.check_resume(_saved(), smoke.get_config(), step=3)
    assert capsys.readouterr().out == ""


def test_changes_to_what_the_state_means_are_refused_naming_each_field():
    saved = _saved(rollout__group_size=16, rollout__mode="sequential", model__preset="bench",
                   seed=7, total_steps=999)
    with pytest.raises(config_diff.ConfigChanged) as info:
        config_diff.check_resume(saved, smoke.get_config(), step=3)
    assert info.value.exit_code == 2
    assert [p.field for p in info.value.problems] == ["model.preset", "rollout.group_size",
                                                      "rollout.mode", "seed"]
    message = str(info.value)
    assert "checkpoint 3 was saved with, in 4 field(s)" in message
    assert "rollout.mode: 'sequential' in the checkpoint, 'pipeline' now; fix: set it back to " \
           "'sequential'" in message
    assert "--allow_config_change=model.preset,rollout.group_size,rollout.mode,seed" in message


def test_allowed_changes_and_other_fields_pass_with_one_note(capsys):
    saved = _saved(rollout__group_size=16, data__arith__max_operand=99, total_steps=999,
                   checkpoint__every_steps=5)
    config_diff.check_resume(saved, smoke.get_config(), step=3,
                             allowed=["rollout.group_size", "data"])
    note = capsys.readouterr().out
    assert note.count("\n") == 1 and note.startswith("config changed since checkpoint 3: ")
    for change in ("rollout.group_size 16 -> 4", "data.arith.max_operand 99 -> 20",
                   "total_steps 999 -> ", "checkpoint.every_steps 5 -> 1"):
        assert change in note


def test_fields_new_since_the_checkpoint_are_noted_not_refused(capsys):
    saved = _saved()
    del saved["rollout"]["resume"]  # written before the field existed
    saved["rollout"]["scheduler"] = "stream"  # a field since removed
    config_diff.check_resume(saved, smoke.get_config(), step=3)
    note = capsys.readouterr().out
    assert "rollout.resume (absent) -> 'recompute'" in note
    assert "rollout.scheduler 'stream' -> (absent)" in note
    config_diff.check_resume(None, smoke.get_config(), step=3)
    assert "holds no config" in capsys.readouterr().out


def test_an_allowed_name_that_is_no_field_is_a_config_error():
    config_diff.check_allowed(["rollout", "rollout.group_size"], smoke.get_config())
    with pytest.raises(ConfigError, match=r"--allow_config_change: 'rollout.groupsize' is not a "
                                          r"config field or section"):
        config_diff.check_allowed(["rollout.groupsize", "seed"], smoke.get_config())

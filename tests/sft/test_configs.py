"""The toy study's configs (`experiments/configs/study.py`) pass the run-time validation (`sft` is
checked like `train`) and, shrunk, build and run: SFT, then a couple of RL steps per variant."""
import json
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from mars_jax import console
from mars_jax.config_validation import validate
from mars_jax.models import Qwen3, Qwen3Config
from mars_jax.rl import trainer
from mars_jax.sft import job as sft_job
from mars_jax.sft.job import ARCHS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "configs"))
import study  # noqa: E402
import study_weak  # noqa: E402
from common import base_config  # noqa: E402

ROLES = {"marsrl": "all", "marsrl_s": "solver", "marsrl_vc": "vc"}


@pytest.mark.parametrize("module", [study, study_weak])
@pytest.mark.parametrize("variant,roles", ROLES.items())
def test_study_variants_are_valid_and_train_their_roles(module, variant, roles):
    config = module.get_config(variant)
    validate(config, base_config(), device_count=1)
    assert config.rollout.roles_trained == roles
    assert config.model.checkpoint == f"{module.ROOT}/sft/model"
    assert config.rollout.group_size == 8 and config.eval.num_problems >= 500


def test_study_sft_is_valid_and_shares_the_problems():
    config = study.get_config("sft")
    checked = config.copy_and_resolve_references()
    checked.job = "train"  # as experiments/run.py checks an sft config
    validate(checked, base_config(), device_count=1)
    # It continues the committed warm start, a `small` model.
    saved = json.loads((Path(config.model.checkpoint) / "config.json").read_text())
    assert {k: saved[k] for k in ARCHS["small"]} == ARCHS["small"]
    assert dict(config.data.arith) == dict(study.get_config("marsrl").data.arith)


def test_unknown_args_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        study.get_config("grpo")


def test_study_configs_run_shrunk(tmp_path):
    """A few SFT steps, then two RL steps of each variant from that model (tiny sizes)."""
    sft = study.get_config("sft")
    sft.sft.steps, sft.sft.rows, sft.sft.eval_every, sft.sft.holdout_problems = 2, 2, 2, 2
    sft_job.run(sft, str(tmp_path / "sft"))
    for variant, roles in ROLES.items():
        rl = study.get_config(variant)
        rl.model.checkpoint = str(tmp_path / "sft" / "model")
        rl.total_steps, rl.checkpoint.every_steps = 2, 2
        rl.rollout.prompts_per_step, rl.rollout.group_size = 1, 2
        # A 2-step SFT model's groups are mostly all wrong: count them; sequential mode, so that
        # each step holds whole trees.
        rl.rollout.drop_zero_variance, rl.rollout.mode = False, "sequential"
        # Room for the Solver's thought and its one-line solution (a solution cut off inside
        # its thought has no visible text to verify); Verifier reports are cut short.
        rl.rollout.max_new_tokens.update(solver=study.MAX_NEW_TOKENS["solver"], verifier=16,
                                         corrector=16)
        probed = variant == "marsrl"  # the held-out probe before step 1 and after step 2
        rl.eval.probe_every, rl.eval.probe_problems = (2, 2) if probed else (0, 256)
        rl.eval.max_new_tokens.update(rl.rollout.max_new_tokens)
        trainer.train(rl, str(tmp_path / variant))
        rows = console.read_metrics(tmp_path / variant)
        if probed:
            probes = [r["step"] for r in rows if "probe/solver_accuracy" in r]
            assert probes == [0, 2] and 0 <= rows[-1]["probe/verifier_balanced_accuracy"] <= 1
            rows = rows[1:]
        assert [r["step"] for r in rows] == [1, 2], variant
        assert all(r["reward/solver"] is not None for r in rows), variant
        # MarsRL-S stops after the Solver; the others verify each step's solutions.
        assert (rows[0]["reward/verifier"] is not None) == (variant != "marsrl_s"), variant


@pytest.mark.parametrize("variant", ROLES)
def test_study_weak_runs_as_the_paper_on_the_strong_study_s_problems(variant):
    config = study_weak.get_config(variant)
    assert (config.rollout.selection, config.rollout.temperature) == ("adaptive", 1.0)
    assert config.rollout.verifier_selection == "balanced"  # Study 7's amendment
    # Pipeline mode on the engine, an update every prompts_per_step x group_size trained samples.
    assert (config.rollout.decode_engine, config.rollout.mode) == ("engine", "pipeline")
    assert config.rollout.samples_per_update == 32 * 8
    assert study_weak.ROOT != study.ROOT
    # Problems, budgets and the evaluation are the strong study's.
    strong = study.get_config(variant)
    assert dict(config.data.arith) == dict(strong.data.arith)
    assert config.eval.to_dict() == {**strong.eval.to_dict(), "probe_every": 25,
                                     "engine_slots": 256}


def test_study_weak_sft_continues_study5_and_probes_each_saved_step():
    config = study_weak.get_config("sft")
    checked = config.copy_and_resolve_references()
    checked.job = "train"
    validate(checked, base_config(), device_count=1)
    assert config.model.checkpoint == "/tmp/mars_study_weak/p8"
    assert config.sft.steps % config.sft.probe_every == 0
    step = study_weak.WEAK_STEP
    assert step % config.sft.probe_every == 0 < step < config.sft.steps
    with pytest.raises(ValueError, match="unknown"):
        study_weak.get_config("grpo")


def test_study_weak_marsrl_runs_shrunk(tmp_path):
    """Two MarsRL steps of `study_weak` (adaptive selection, balanced for the Verifier, T=1.0,
    pipeline on the engine) from its committed warm start, tiny sizes: every role's
    groups-without-gradient and truncation shares are logged."""
    rl = study_weak.get_config("marsrl")
    rl.model.checkpoint = str(Path(study_weak.RESULTS) / "sft" / "model")
    rl.total_steps, rl.checkpoint.every_steps, rl.eval.probe_every = 2, 2, 0
    rl.rollout.prompts_per_step, rl.rollout.group_size = 1, 2
    rl.rollout.samples_per_update = 2
    rl.rollout.max_new_tokens.update(solver=study.MAX_NEW_TOKENS["solver"], verifier=16,
                                     corrector=16)
    trainer.train(rl, str(tmp_path / "marsrl"))
    rows = console.read_metrics(tmp_path / "marsrl")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("groups_all_wrong", "groups_all_right", "truncated"):
        assert 0 <= rows[0][f"{key}/solver"] <= 1, key
    assert rows[-1]["truncated/verifier"] == 1.0  # 16 tokens cut every Verifier reply


# Hand-counted: embedding and LM head 2 x 272 x hidden, per layer q/k/v/o + SwiGLU (+ router and
# experts for the MoE) + 4 norms of head_dim / hidden, and the final norm.
@pytest.mark.parametrize("name,moe,size", [("toy", True, 1_058_176), ("small", False, 857_472),
                                           ("mini", False, 158_080)])
def test_toy_architectures_are_qwen3_under_20m_parameters(name, moe, size):
    config = Qwen3Config(**ARCHS[name])
    model = nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert (config.model_type == "qwen3_moe") == moe and count == size <= 20_000_000
    assert config.vocab_size >= 261  # the tiny byte-level tokenizer

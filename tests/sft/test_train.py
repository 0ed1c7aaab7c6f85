"""SFT packing keeps examples apart, and the sft job lowers the held-out loss and saves a model."""
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from mars_jax.data import arith
from mars_jax.data.tokenizer import tiny_tokenizer
from mars_jax.models import create_model, from_pretrained, get_preset
from mars_jax.models.qwen3 import positions_from_segments
from mars_jax.sft import job, train

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "configs"))
from common import base_config  # noqa: E402

RATES = dict(solver_error_rate=0.3, verifier_flawed_rate=0.5)


def examples(num_problems: int, seed: int = 0) -> list[train.Encoded]:
    problems = arith.load_split("train")[:num_problems]
    return list(train.encoded_examples(problems, tiny_tokenizer(), random.Random(seed), **RATES))


def test_pack_keeps_every_example_whole_and_in_order():
    encoded = examples(6)
    batches = [part for (part,) in train.pack(encoded, rows=2, row_tokens=640)]
    pieces = []
    for batch in batches:
        positions = np.asarray(positions_from_segments(batch.segments))
        for row in range(2):
            for segment in range(1, batch.segments[row].max() + 1):
                where = batch.segments[row] == segment
                assert np.array_equal(positions[row][where], np.arange(where.sum()))
                pieces.append((batch.tokens[row][where].tolist(), batch.roles[row][where]))
    assert [tokens for tokens, _ in pieces] == [e.prompt + e.reply for e in encoded]
    for (tokens, roles), e in zip(pieces, encoded):
        assert np.array_equal(roles, [0] * len(e.prompt) + [train.ROLES.index(e.role) + 1] * len(e.reply))
    with pytest.raises(ValueError, match="exceeds row_tokens"):
        next(train.pack(encoded, rows=1, row_tokens=100))


def test_two_parts_take_short_examples_in_short_rows_and_keep_batches_consecutive():
    encoded = examples(12)  # Solver examples fit 128 tokens; Verifier and Corrector ones do not
    assert any(len(e) <= 128 for e in encoded) and any(len(e) > 128 for e in encoded)
    batches = list(train.pack(encoded, rows=2, row_tokens=640, short_rows=3, short_row_tokens=128))
    seen = []
    for short, long in batches:
        assert short.tokens.shape == (3, 128) and long.tokens.shape == (2, 640)
        pieces = []
        for part in (short, long):
            positions = np.asarray(positions_from_segments(part.segments))
            for row in range(part.tokens.shape[0]):
                for segment in range(1, part.segments[row].max() + 1):
                    where = part.segments[row] == segment
                    assert np.array_equal(positions[row][where], np.arange(where.sum()))
                    pieces.append(part.tokens[row][where].tolist())
        # A batch is the next run of examples of the stream, in any order across its parts.
        run = [e.prompt + e.reply for e in encoded[len(seen):len(seen) + len(pieces)]]
        assert sorted(pieces) == sorted(run)
        seen += run
    assert len(seen) == len(encoded)
    assert any(short.segments[0].max() > 0 for short, _ in batches)  # short rows are used
    with pytest.raises(ValueError, match="must be positive and below"):
        next(train.pack(encoded, rows=2, row_tokens=640, short_rows=1, short_row_tokens=640))


def test_packed_loss_equals_the_sum_of_separate_losses():
    model = create_model(get_preset("tiny"), seed=0)
    a, b = examples(1)[:2]
    together = train.loss_terms(model, next(train.pack([a, b], rows=1, row_tokens=1024)))
    alone = [train.loss_terms(model, next(train.pack([e], rows=1, row_tokens=1024))) for e in (a, b)]
    # In two parts (`a` in a short row, `b` in a long one) the terms add up the same.
    short = min(a, b, key=len)
    parts = next(train.pack([a, b], rows=1, row_tokens=1024, short_rows=1,
                            short_row_tokens=len(short)))
    assert parts[0].segments.max() == 1 and parts[1].segments.max() == 1
    for key in ("nll", "tokens"):
        np.testing.assert_allclose(float(train.loss_terms(model, parts)[key]),
                                   float(together[key]), rtol=1e-4)
    assert float(together["tokens"]) == len(a.reply) + len(b.reply)
    np.testing.assert_allclose(float(together["nll"]), sum(float(t["nll"]) for t in alone), rtol=1e-4)
    np.testing.assert_allclose(float(together[f"nll/{a.role}"]), float(alone[0]["nll"]), rtol=1e-4)


def test_sft_job_lowers_heldout_loss_and_saves_a_loadable_model(tmp_path):
    config = base_config()
    config.job, config.tokenizer, config.rollout.prompt_style = "sft", "tiny", "compact"
    config.sft.steps, config.sft.rows, config.sft.row_tokens = 12, 4, 640
    config.sft.holdout_problems, config.sft.eval_every = 4, 12
    config.optimizer.learning_rate = 3e-3
    summary = job.run(config, str(tmp_path))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    initial, final = lines[0]["heldout/loss"], lines[-1]["heldout/loss"]
    assert lines[0]["step"] == 0 and lines[-1]["step"] == 12
    assert final < initial - 1.0, (initial, final)
    assert set(summary) == {"loss", "loss/solver", "loss/verifier", "loss/corrector"}
    # The saved checkpoint is the trained model: same held-out loss after loading it back.
    loaded = from_pretrained(tmp_path / "model")
    problems = arith.load_split("train")[-4:]
    heldout = list(train.pack(train.encoded_examples(problems, tiny_tokenizer(), random.Random(-1),
                                                     **RATES), rows=4, row_tokens=640))
    graphdef, params = nnx.split(loaded, nnx.Param)
    np.testing.assert_allclose(train.heldout_loss(params, heldout, graphdef)["loss"], final,
                               rtol=1e-5)


def _losses(config, workdir) -> list[float]:
    job.run(config, str(workdir))
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]


def test_stop_at_ends_the_job_on_the_full_schedule(tmp_path):
    """`sft.stop_at` trains the first steps of a run of `sft.steps`: the same losses under its
    cosine schedule, unlike a run of `stop_at` steps, whose schedule decays sooner."""
    config = base_config()
    config.job, config.tokenizer, config.rollout.prompt_style = "sft", "tiny", "compact"
    config.sft.steps, config.sft.rows, config.sft.row_tokens = 8, 2, 640
    config.sft.holdout_problems, config.sft.eval_every = 2, 8
    config.optimizer.learning_rate, config.optimizer.schedule = 3e-3, "cosine"
    full = _losses(config, tmp_path / "full")
    config.sft.stop_at = 4
    stopped = _losses(config, tmp_path / "stopped")
    config.sft.steps, config.sft.stop_at = 4, 0
    short = _losses(config, tmp_path / "short")
    assert len(full) == 8 and len(stopped) == len(short) == 4
    np.testing.assert_allclose(stopped, full[:4], rtol=1e-6)
    assert abs(short[3] - full[3]) > 1e-4, (short, full)
    assert (tmp_path / "stopped" / "model" / "config.json").exists()

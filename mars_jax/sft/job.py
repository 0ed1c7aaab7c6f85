"""The `sft` job behind experiments/run.py: trains on generated role traces, saves an HF checkpoint.

Logs the held-out loss per role (the last `sft.holdout_problems` train problems, never trained on)
and saves `workdir/model/` for an RL config's `model.checkpoint`. With `sft.probe_every` > 0 it
probes each role's decisions and saves `workdir/model_step<N>/`. A rerun starts over.
"""
from __future__ import annotations

import json
import os
import random

import jax
import tqdm
from flax import nnx
from ml_collections import ConfigDict

from mars_jax import builders, storage
from mars_jax.metrics import MetricsWriter
from mars_jax.models import Qwen3, Qwen3Config, create_model, save_pretrained
from mars_jax.optimizer import make_optimizer
from mars_jax.sft.config import probe_settings
from mars_jax.sft.probe import probe_model
from mars_jax.sft.train import encoded_examples, example_stream, heldout_loss, pack, sft_step

# Toy architectures (`sft.arch`), for the byte-level `tiny` tokenizer (261 tokens).
ARCHS: dict[str, dict] = {
    # 1.06M parameters: 4 layers, hidden 128, 8 experts of 64 (top-2) in every layer.
    "toy": dict(vocab_size=272, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, intermediate_size=512,
                moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, rope_theta=10_000.0, max_position_embeddings=2048),
    # 0.86M parameters, dense: 4 layers, hidden 128 (the toy study of experiments/RESULTS.md).
    "small": dict(vocab_size=272, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, intermediate_size=384,
                  rope_theta=10_000.0, max_position_embeddings=2048),
    # 3.3M parameters, dense: 4 layers, hidden 256.
    "medium": dict(vocab_size=272, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=32, intermediate_size=768,
                   rope_theta=10_000.0, max_position_embeddings=2048),
    # 0.16M parameters, dense: 2 layers, hidden 64 (the README's main job, learns in minutes).
    "mini": dict(vocab_size=272, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=256,
                 rope_theta=10_000.0, max_position_embeddings=2048),
}


def build_model(config: ConfigDict) -> Qwen3:
    """`model.checkpoint` when set (continues from it), else `sft.arch`, else `model.preset`."""
    if config.sft.arch and not config.model.checkpoint:
        if config.sft.arch not in ARCHS:
            raise ValueError(f"sft.arch: {config.sft.arch!r} is not one of {sorted(ARCHS)}")
        arch = Qwen3Config(**ARCHS[config.sft.arch], **builders.model_overrides(config))
        return create_model(arch, seed=config.seed)
    return builders.build_model(config, mesh=None)


def _save_model(model: Qwen3, target: str | os.PathLike) -> None:
    """`save_pretrained` to `target`, local or `gs://` (staged locally, then copied up)."""
    staging = storage.LocalStaging(target)
    save_pretrained(model, staging.local)
    staging.publish()


def run(config: ConfigDict, workdir: str) -> dict[str, float]:
    """Trains `sft.steps` steps (`sft.stop_at` if set); returns the final held-out losses."""
    s, out = config.sft, storage.path(workdir)
    last = s.stop_at or s.steps
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = builders.build_tokenizer(config)
    model = build_model(config)
    problems = list(builders.load_problems(config.data))
    if not 0 < s.holdout_problems < len(problems):
        raise ValueError(f"sft.holdout_problems: {s.holdout_problems} leaves no problem to train "
                         f"on or none to hold out ({len(problems)} problems)")
    train_problems, holdout = problems[:-s.holdout_problems], problems[-s.holdout_problems:]
    rates = dict(solver_error_rate=s.solver_error_rate, verifier_flawed_rate=s.verifier_flawed_rate,
                 style=config.rollout.prompt_style)
    rows = dict(rows=s.rows, row_tokens=s.row_tokens, short_rows=s.short_rows,
                short_row_tokens=s.short_row_tokens)
    heldout = list(pack(encoded_examples(holdout, tokenizer, random.Random(-1), **rates),
                        **rows))
    batches = pack(example_stream(train_problems, tokenizer, seed=config.seed, keep=dict(s.keep),
                                  **rates), **rows)
    optimizer = make_optimizer(**{**dict(config.optimizer), "decay_steps": s.steps})
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = optimizer.init(params)
    (out / "metrics.jsonl").unlink(missing_ok=True)  # no resume: a rerun starts over
    writer = MetricsWriter(out)
    summary = heldout_loss(params, heldout, graphdef)
    try:
        writer.write(0, {f"heldout/{k}": v for k, v in summary.items()})
        for step in tqdm.tqdm(range(1, last + 1), desc="sft", disable=jax.process_index() != 0):
            params, opt_state, metrics = sft_step(params, opt_state, next(batches),
                                                  graphdef=graphdef, optimizer=optimizer)
            metrics = {k: float(v) for k, v in metrics.items()}
            if step % s.eval_every == 0 or step == last:
                summary = heldout_loss(params, heldout, graphdef)
                metrics.update({f"heldout/{k}": v for k, v in summary.items()})
            if s.probe_every and (step % s.probe_every == 0 or step == last):
                model = nnx.merge(graphdef, params)
                decisions = probe_model(model, tokenizer, holdout,
                                        probe_settings(config, s.probe_slots))
                _save_model(model, out / f"model_step{step}")
                metrics.update(decisions)
                summary = {**summary, **decisions}
            writer.write(step, metrics)
    finally:
        writer.close()
    _save_model(nnx.merge(graphdef, params), out / "model")
    storage.write_text(out / "summary.json", json.dumps(summary, indent=2, sort_keys=True))
    return summary

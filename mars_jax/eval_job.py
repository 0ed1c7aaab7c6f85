"""The `eval_system` job: Solver-only and full V–C system avg@k over a dataset split.

Written under `workdir/eval/` (records appended as pairs finish, so a rerun resumes). With
`eval.policy='http'` the key in `eval.api_key_env` is sent as a Bearer token.
"""
from __future__ import annotations

import json
import os

import jax
import tqdm
from ml_collections import ConfigDict
from tensorboardX import SummaryWriter

from mars_jax import builders, preemption, sharding, storage
from mars_jax.agents.eval import EvalProblem, evaluate
from mars_jax.agents.http_policy import HttpPolicy
from mars_jax.agents.policy import Policy, RoutedPolicy
from mars_jax.agents.sampler_policy import SamplerPolicy
from mars_jax.agents.system import LoopConfig
from mars_jax.sampling.config import eval_engine_settings


def build_policy(config: ConfigDict) -> Policy:
    """The in-process sampler, or an OpenAI-compatible server (optionally a separate Solver's)."""
    e = config.eval
    if e.policy == "sampler":
        mesh = builders.build_mesh(config)
        with sharding.use_mesh(mesh):
            model = builders.build_model(config, mesh)
        return SamplerPolicy(model, builders.build_tokenizer(config), temperature=e.temperature,
                             top_p=e.top_p, enable_thinking=config.rollout.enable_thinking,
                             engine=eval_engine_settings(config, e.engine_slots))
    if e.policy == "http":
        api_key = os.environ.get(e.api_key_env) if e.api_key_env else None
        http = lambda url: HttpPolicy(url, e.served_model, api_key=api_key,
                                      temperature=e.temperature, top_p=e.top_p,
                                      timeout_s=e.timeout_s, max_concurrency=e.max_concurrency)
        vc = http(e.vc_base_url)
        return RoutedPolicy(vc, {"solver": http(e.solver_base_url)}) if e.solver_base_url else vc
    raise ValueError(f"eval.policy: {e.policy!r} is not 'sampler' or 'http'")


def load_eval_problems(config: ConfigDict) -> list[EvalProblem]:
    return [EvalProblem(str(r["id"]), r["problem"], str(r["answer"]))
            for r in builders.load_eval_records(config, config.eval.num_problems)]


def run(config: ConfigDict, workdir: str) -> dict:
    """Evaluates and returns the summary; one process only (it alone writes its records)."""
    if jax.process_count() > 1:
        raise ValueError(f"eval_system runs on one process, not {jax.process_count()}: for a "
                         "model larger than one host, serve it and set eval.policy='http'")
    out = storage.path(workdir) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    problems = load_eval_problems(config)
    e = config.eval
    loop = LoopConfig(k_accept=e.k_accept, max_iterations=e.max_iterations,
                      max_retries=e.max_retries, max_new_tokens=dict(e.max_new_tokens),
                      prompt_style=config.rollout.prompt_style, fallback=e.fallback)
    bar = tqdm.tqdm(total=len(problems) * e.num_samples, desc="eval")

    def on_round(info) -> None:
        bar.set_postfix(round=info.round, **info.requests_by_role)
        bar.n = info.finished
        bar.refresh()

    with preemption.catch_sigterm(config.preemption_grace_s) as notice:
        try:
            records, summary = evaluate(problems, build_policy(config), num_samples=e.num_samples,
                                        config=loop, records_path=os.fspath(out / "records.jsonl"),
                                        on_round=on_round, should_stop=notice)
        except preemption.Stopped as stopped:
            raise preemption.Preempted(f"SIGTERM: {stopped}; the finished pairs are recorded in "
                                       f"{out / 'records.jsonl'}") from None
        finally:
            bar.close()
    storage.write_text(out / "summary.json", json.dumps(summary, indent=2, sort_keys=True))
    # Written locally and copied up: tensorboardX's own gs:// writer uploads its file again
    # whenever it is garbage-collected, at exit too.
    tensorboard = storage.LocalStaging(out / "tensorboard")
    with SummaryWriter(os.fspath(tensorboard.local)) as writer:
        for key, value in summary.items():
            if isinstance(value, (int, float)):
                writer.add_scalar(f"eval/{key}", value, 0)
    tensorboard.publish()
    return summary

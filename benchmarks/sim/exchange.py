r"""What the host exchange's lock-step costs: P hosts, each the real streaming scheduler
(`mars_jax.rl.streaming.StreamingRollouts`, pipeline mode) on its own simulated engine
(`sim.engine.SimEngine`, one host's chips), agreeing through a simulated `distributed.HostGroup`
on the simulated clock: at every exchange each host waits until the last host arrives (plus
`--exchange_ms` of coordinator round trips); the update runs on every chip of the job.

  python benchmarks/sim/exchange.py                          # 8 and 64 v5p hosts, jitter 0 and 0.3
  python benchmarks/sim/exchange.py --hosts=8 --jitter=0.3 --chunks_per_round=1,8

Each host's decode time per chunk is the cost model's times a factor drawn per host and chunk
from a log-normal of sigma `--jitter` (stragglers: host CPU stalls, GC, a slow link); the load
differs between hosts on its own too (each host's requests, prefills and lengths are its own).
`--chunks_per_round` k: hosts exchange after every k engine chunks (events of `SimEngine`)
instead of every one (`StreamSettings(chunks_per_round=k)`). Reported per setting: the share
of host time spent waiting in the exchange (sum over hosts of the wait / sum of host time, from
the end of update `--warmup` to the end of the last), the update cadence and the trained
samples per accelerator-hour.

Workload: the paper's (`pipeline_sim.Workload`: Qwen3-30B-A3B, group 8, fan-out 2, 5 stages),
output lengths `sim.lengths.LengthModel` scaled by `--length_scale` (budgets and prompt cap
with them) so that a 64-host run simulates in minutes; `--samples_per_host` x hosts trained
samples per update.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.pipeline_sim import (MemoStreaming, Workload, hardware,  # noqa: E402
                                     mesh_slots)
from benchmarks.sim.agents import (  # noqa: E402
    SimRollouts, SimTokenizer, problems, role_of_prompt, sim_encode)
from benchmarks.sim.cost import CHIPS, MeshCost, ModelCost  # noqa: E402
from benchmarks.sim.engine import SimEngine  # noqa: E402
from benchmarks.sim.lengths import LengthModel  # noqa: E402
from mars_jax.models import get_preset  # noqa: E402
from mars_jax.rl.streaming import StreamSettings, auto_problems_per_update  # noqa: E402

CHIPS_PER_HOST = {"v5p": 4, "h200": 8}


class Jittered:
    """A cost model whose decode and prefill times are `factor` x `base`'s; `draw()` draws the
    next factor (log-normal of sigma `jitter`, mean 1)."""

    def __init__(self, base, jitter: float, rng: np.random.Generator):
        self.base, self.jitter, self.rng, self.factor = base, jitter, rng, 1.0

    def draw(self) -> None:
        if self.jitter:
            self.factor = float(self.rng.lognormal(-self.jitter ** 2 / 2, self.jitter))

    def decode_seconds(self, *args, **kwargs) -> float:
        return self.factor * self.base.decode_seconds(*args, **kwargs)

    def prefill_seconds(self, *args, **kwargs) -> float:
        return self.factor * self.base.prefill_seconds(*args, **kwargs)


class JitteredEngine(SimEngine):
    """`SimEngine` whose cost factor is drawn afresh for every chunk (`Jittered.draw`)."""

    def _step(self) -> bool:
        self.cost.draw()
        return super()._step()


class Clocks:
    """The hosts' meeting points on the simulated clock: `meet(h, extra)` returns once every
    host has called it, having moved host h's engine on to the latest host's time + `extra`
    seconds (the wait is counted as exchange time when `exchange`)."""

    def __init__(self, engines: list[SimEngine], exchange_s: float):
        self.engines, self.exchange_s = engines, exchange_s
        self.waited = [0.0] * len(engines)
        self.rounds = 0
        self._values: list = [None] * len(engines)
        self._barrier = threading.Barrier(len(engines), action=self._all_arrived)
        self._target = 0.0
        self._total = None

    def _all_arrived(self) -> None:
        self._target = max(e.now for e in self.engines)
        self._gathered = list(self._values)

    def meet(self, host: int, value=None, *, exchange: bool) -> list:
        self._values[host] = value
        self._barrier.wait()
        engine = self.engines[host]
        wait = self._target - engine.now
        if exchange:
            self.waited[host] += wait
            if host == 0:
                self.rounds += 1
        engine.advance(wait + (self.exchange_s if exchange else 0.0))
        gathered = self._gathered
        self._barrier.wait()  # everyone has read this meeting's values
        return gathered

    def abort(self) -> None:
        self._barrier.abort()


class SimHosts:
    """`distributed.HostGroup` on the simulated clock for host `index` (the attributes and
    `gather` the scheduler uses)."""

    def __init__(self, clocks: Clocks, index: int):
        self.clocks, self.index, self.count = clocks, index, len(clocks.engines)
        self.seconds = 0.0

    def gather(self, value) -> list:
        return self.clocks.meet(self.index, value, exchange=True)


@dataclasses.dataclass(frozen=True)
class Setting:
    hosts: int
    jitter: float
    chunks_per_round: int


def simulate(setting: Setting, args) -> dict:
    """Runs `args.updates` updates on `setting.hosts` hosts; the measured window's figures."""
    hw = hardware(args.hardware)
    per_host = CHIPS_PER_HOST[hw.chip]
    chips = per_host * setting.hosts
    model = ModelCost.of(get_preset("qwen3_30b_a3b"))
    scale = args.length_scale
    workload = dataclasses.replace(
        Workload(), max_new_tokens=int(64 * 1024 * scale), max_prompt_tokens=int(32 * 1024 * scale),
        answer_tokens=tuple((role, int(n * scale)) for role, n in Workload().answer_tokens))
    lengths = LengthModel(cap=workload.max_new_tokens, sigma=args.sigma,
                          solver_mean_start=19_000 * scale, solver_mean_end=28_000 * scale,
                          seed=args.seed)
    chip = CHIPS[hw.chip]
    decode = MeshCost(model, chip, per_host, step_overhead_s=args.step_overhead_ms / 1e3)
    train = MeshCost(model, chip, chips)
    # the train state over all chips of the job, the rest of each host's HBM for its slots
    slots = mesh_slots(dataclasses.replace(hw, chips=chips), model, per_host,
                       resident="train_state",
                       positions=workload.max_prompt_tokens + workload.max_new_tokens)
    costs = [Jittered(decode, setting.jitter, np.random.default_rng([args.seed, h]))
             for h in range(setting.hosts)]
    engines = [JitteredEngine(cost, lengths, num_slots=slots,
                         max_length=workload.max_prompt_tokens + workload.max_new_tokens,
                         role_of=role_of_prompt, answer_tokens=dict(workload.answer_tokens),
                         chunk_steps=args.chunk_steps, one_chunk=True) for cost in costs]
    clocks = Clocks(engines, args.exchange_ms / 1e3)
    results: list[dict | None] = [None] * setting.hosts
    errors: list[BaseException] = []

    def host(h: int) -> None:
        tokenizer = SimTokenizer()
        rollouts = SimRollouts(tokenizer, workload.rollout_config(), seed=args.seed,
                               encode=sim_encode, correct_rates=dict(workload.correct_rates))
        scheduler = MemoStreaming(
            rollouts, engines[h], problems(workload.problem_words, args.seed * 1000 + h),
            StreamSettings(
                mode="pipeline", prompts_per_step=workload.prompts_per_step,
                samples_per_update=args.samples_per_host * setting.hosts,
                max_problems_per_update=auto_problems_per_update(workload.prompts_per_step),
                max_inflight_rows=2 * slots,
                staleness_bound=args.staleness_bound, resume="keep", roles_trained="all",
                drop_zero_variance=workload.drop_zero_variance,
                mask_truncated=False,
                sampling=dict(temperature=0.85, top_p=1.0, top_k=0),
                chunks_per_round=setting.chunks_per_round),
            stop_ids=(tokenizer.eos_token_id,), clock=engines[h].clock,
            hosts=SimHosts(clocks, h))
        version, ends, trained, waited = 0, [], [], []
        for _ in range(args.updates):
            batch = scheduler.collect(version)
            tokens = [len(g[i].prompt_ids) + len(g[i].response_ids) for g in batch.groups
                      for i, _ in scheduler.rules.trained(g)]
            everyone = clocks.meet(h, tokens, exchange=False)  # the update: every chip
            seconds = sum(train.update_seconds(n) for host_tokens in everyone
                          for n in host_tokens)
            engines[h].advance(seconds)
            version += 1
            scheduler.weights_updated(None, version)
            ends.append(engines[h].now)
            trained.append(sum(map(len, everyone)))
            waited.append(clocks.waited[h])
        results[h] = dict(ends=ends, trained=trained, waited=waited)

    def run(h: int) -> None:
        try:
            host(h)
        except BaseException as error:  # noqa: BLE001 - reported below; the others released
            errors.append(error)
            clocks.abort()

    threads = [threading.Thread(target=run, args=(h,)) for h in range(setting.hosts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    w = args.warmup
    window = results[0]["ends"][-1] - results[0]["ends"][w - 1]
    waited = sum(r["waited"][-1] - r["waited"][w - 1] for r in results)
    samples = sum(results[0]["trained"][w:])
    return dict(setting=setting, slots=slots, share=waited / (window * setting.hosts),
                rounds=clocks.rounds, wall_h=window / 3600 / (args.updates - w),
                samples_per_update=statistics.mean(results[0]["trained"][w:]),
                per_1k_chip_h=chips * window / 3600 / (samples / 1000))


def arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", default="8,64")
    parser.add_argument("--jitter", default="0,0.3",
                        help="sigma of the per-host, per-round decode-time factor (log-normal)")
    parser.add_argument("--chunks_per_round", default="1",
                        help="engine chunks between two exchanges (comma-separated settings)")
    parser.add_argument("--hardware", default="v5p-8", help="the chip kind (v5p-N or h200xN)")
    parser.add_argument("--length_scale", type=float, default=1 / 16)
    parser.add_argument("--sigma", type=float, default=0.7)
    parser.add_argument("--samples_per_host", type=int, default=256,
                        help="trained samples per update per host (the update size grows with "
                             "the job, as the slots do)")
    parser.add_argument("--staleness_bound", type=int, default=3)
    parser.add_argument("--chunk_steps", type=int, default=16)
    parser.add_argument("--step_overhead_ms", type=float, default=2.0)
    parser.add_argument("--exchange_ms", type=float, default=3.0,
                        help="coordinator round trips per exchange (set, count, read)")
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> None:
    args = arg_parser().parse_args()
    print("hosts  jitter  chunks/round  slots/host  exchange wait  rounds  h/update  "
          "samples/update  chip-h/1k samples  (simulated in)")
    for hosts in map(int, args.hosts.split(",")):
        for jitter in map(float, args.jitter.split(",")):
            for k in map(int, args.chunks_per_round.split(",")):
                began = time.perf_counter()
                r = simulate(Setting(hosts, jitter, k), args)
                print(f"{hosts:5d}  {jitter:6.2f}  {k:12d}  {r['slots']:10d}  {r['share']:13.1%}  "
                      f"{r['rounds']:6d}  {r['wall_h']:8.3f}  {r['samples_per_update']:14,.0f}  "
                      f"{r['per_1k_chip_h']:17.2f}  ({time.perf_counter() - began:.0f} s)",
                      flush=True)


if __name__ == "__main__":
    main()

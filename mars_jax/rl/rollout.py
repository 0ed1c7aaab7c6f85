"""Grouped agentic rollouts: the per-problem tree Solver -> Verifier1 -> Corrector1 -> Verifier2 ->
Corrector2, graded with agent-specific rewards.

A problem's stage s spawns once every rollout of stage s-1 has finished: the Solver samples a
group of G; each later stage picks `fan_out` parents among the outputs of the stage before
(`mars_jax.rl.selection`; the Corrector only takes Verifier outputs that report an error) and
samples a group of G for each. A tree ends early when no eligible parent remains.

Grading, as the V-C loop judges (`mars_jax.agents.stages`; each output parsed once, for its grade
and its children): a Solver or Corrector output earns 1 when usable (ended by itself, with
visible text) and its boxed answer is right, else 0; one ended by length is never graded from its
text: it earns `truncated_reward` and reaches a Verifier only with `verify_truncated`. A Verifier
output earns 1 when its verdict (ended by itself, Correctness readable) equals the judged
solution's correctness, else 0; without a verdict it never reaches a Corrector. The next agent
sees the parse (the visible solution, the bug report). Text inside an unclosed thought
(`thinking_open`: the generation prompt opens `<think>`) is never read as an answer or verdict,
and an output with no visible text never reaches a Verifier.

Each token keeps the log-probability, and with routing replay the expert ids, recorded by the
decode that produced it; a rollout restored mid-output is resubmitted as a continuation.

Context overflow: a Verifier or Corrector prompt over `max_prompt_tokens` keeps only the tail of
its embedded solution (then report), after `CUT_MARKER`, halving until it fits (`context_cuts`).
A prompt that cannot fit is not decoded: a too-long Solver prompt skips its problem, a child that
still overflows is not spawned (`context_drops`, with a warning). Overflow never stops training.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mars_jax.agents import prompts, stages
from mars_jax.agents.policy import Completion
from mars_jax.data.tokenizer import generation_opens_thinking
from mars_jax.rl.selection import Candidate, select_parents
from mars_jax.sampling import EngineOutput

STAGE_ROLES = ("solver", "verifier", "corrector", "verifier", "corrector")
CUT_MARKER = "[... earlier text cut ...]\n"


class ContextOverflow(ValueError):
    """A prompt exceeds `max_prompt_tokens` even after the overflow rule's cuts."""


def selection_rng(seed: int, problem_uid: str, stage: int) -> np.random.Generator:
    """The generator of a stage's parent choice in one problem's tree: a function of (seed,
    problem, stage) only, so the choice ignores the order trees advance in (nothing to save)."""
    return np.random.default_rng([seed, zlib.crc32(problem_uid.encode()), stage])


def sequence_seed(seed: int, group_uid: str) -> int:
    """A group's first sequence seed (members take the next ones): a function of (seed, group uid)
    only, so a rollout draws the same tokens whatever the order of spawning."""
    return zlib.crc32(f"{seed}:{group_uid}".encode()) >> 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How rollouts are grown and cut; the defaults are config.rollout's (the budgets have none)."""

    group_size: int = 8
    fan_out: int = 2
    selection: str = "adaptive"
    verifier_selection: str = ""    # the Verifier stage's policy; "" = `selection`
    max_stages: int = 5
    max_new_tokens: dict            # role -> its outputs' token budget
    max_prompt_tokens: int
    enable_thinking: bool = False
    prompt_style: str = "full"
    truncated_reward: float = 0.0   # reward of a Solver / Corrector output ended by length
    verify_truncated: bool = False  # whether such an output may be a Verifier's parent


@dataclasses.dataclass
class Rollout:
    """One member of a group, possibly partially decoded."""

    uid: str
    problem_uid: str
    stage: int
    parent_uid: str | None
    prompt_ids: list[int]
    solution: str | None = None          # the solution judged (Verifier) / revised (Corrector)
    judged_correct: bool | None = None   # Verifier: is the judged solution actually correct
    response_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    first_version: int | None = None
    finish_reason: str | None = None
    text: str = ""
    reward: float = 0.0
    verdict: bool | None = None          # Verifier: parsed Correctness (None: unreadable/truncated)
    expert_ids: Any = None               # [L_moe, prompt + response, k] recorded routing
    seed: int | None = None              # sequence seed (`sequence_seed`; members consecutive)
    # `text` as its stage parses it (`AgenticRollouts._parse`); not checkpointed, read again.
    parsed: stages.SolutionOutput | stages.VerificationOutput | None = dataclasses.field(
        default=None, compare=False, repr=False)

    @property
    def finished_by_itself(self) -> bool:
        return self.finish_reason == "stop"

    @property
    def solved(self) -> bool:
        """Solver / Corrector: ended by itself and its boxed answer is right."""
        return self.finished_by_itself and self.reward == 1.0

    @property
    def role(self) -> str:
        return STAGE_ROLES[self.stage]

    @property
    def group_key(self) -> tuple[str, int, str | None]:
        return (self.problem_uid, self.stage, self.parent_uid)

    def to_json(self) -> dict:
        """Every field but `expert_ids` (checkpointed as arrays: `AgenticRollouts.routing`) and
        `parsed`."""
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if f.name != "parsed"},
                "response_ids": list(self.response_ids), "logprobs": list(self.logprobs),
                "prompt_ids": list(self.prompt_ids), "expert_ids": None}


@dataclasses.dataclass
class ProblemTree:
    uid: str
    problem: dict
    spawned: dict = dataclasses.field(default_factory=dict)   # stage -> rollouts spawned
    finished: dict = dataclasses.field(default_factory=dict)  # stage -> [finished rollout]


class AgenticRollouts:
    """Pending rollouts of every problem in flight, and the trees that spawn them."""

    def __init__(self, tokenizer, config: RolloutConfig, *, seed: int,
                 encode: Callable[..., list[int]]):
        self.tokenizer, self.config, self.encode = tokenizer, config, encode
        self.seed = seed
        self.thinking_open = generation_opens_thinking(
            tokenizer, enable_thinking=config.enable_thinking, encode=encode)
        self.pending: list[Rollout] = []
        self.trees: dict[str, ProblemTree] = {}
        self.context_cuts = 0
        self.context_drops = 0

    # --- building rollouts -------------------------------------------------------------------

    def _encode(self, messages) -> list[int]:
        return self.encode(self.tokenizer, list(messages),
                           enable_thinking=self.config.enable_thinking, add_generation_prompt=True)

    def _fit(self, build: Callable[..., Any], *texts: str) -> list[int]:
        """Encodes `build(*texts)`, cutting texts (from the first) per the overflow rule; raises
        `ContextOverflow` when even the cut prompt is too long."""
        texts = list(texts)
        ids = self._encode(build(*texts))
        for i in range(len(texts)):
            body = texts[i]
            while len(ids) > self.config.max_prompt_tokens and len(body) > 16:
                body = body[len(body) // 2:]
                texts[i] = CUT_MARKER + body
                ids = self._encode(build(*texts))
                self.context_cuts += 1
        if len(ids) > self.config.max_prompt_tokens:
            raise ContextOverflow(f"a prompt of {len(ids)} tokens still exceeds "
                                  f"rollout.max_prompt_tokens={self.config.max_prompt_tokens}")
        return ids

    def _drop(self, what: str, error: ContextOverflow) -> None:
        self.context_drops += 1
        logging.warning("context overflow: %s dropped (%s)", what, error)

    def _spawn(self, tree: ProblemTree, stage: int, parent: Rollout | None, prompt_ids, **extra):
        index = tree.spawned.get(stage, 0)
        for i in range(self.config.group_size):
            self.pending.append(Rollout(
                uid=f"{tree.uid}/s{stage}/{index + i}", problem_uid=tree.uid, stage=stage,
                parent_uid=None if parent is None else parent.uid, prompt_ids=list(prompt_ids),
                seed=sequence_seed(self.seed, f"{tree.uid}/s{stage}/{index}") + i, **extra))
        tree.spawned[stage] = index + self.config.group_size

    def add_problems(self, problems: Sequence[dict], uids: Sequence[str]) -> None:
        """Starts a tree per problem with a Solver group (skipping problems too long to prompt)."""
        for problem, uid in zip(problems, uids):
            ids = self._encode(prompts.solver_messages(problem["problem"], self.config.prompt_style))
            if len(ids) > self.config.max_prompt_tokens:
                self._drop(f"problem {problem.get('id')}", ContextOverflow(
                    f"Solver prompt of {len(ids)} tokens exceeds "
                    f"rollout.max_prompt_tokens={self.config.max_prompt_tokens}"))
                continue
            tree = ProblemTree(uid=uid, problem=dict(problem))
            self.trees[uid] = tree
            self._spawn(tree, 0, None, ids)

    # --- decoding ----------------------------------------------------------------------------

    def absorb(self, batch: Sequence[Rollout], outputs: Sequence[EngineOutput], version: int
               ) -> list[list[Rollout]]:
        """Appends each rollout's new tokens (`outputs[i]`), grades them, spawns next stages;
        returns the groups that became complete (every member finished)."""
        if len(batch) != len(outputs):
            raise ValueError(f"{len(outputs)} outputs for {len(batch)} rollouts")
        for r, out in zip(batch, outputs):
            if r.first_version is None:
                r.first_version = version
            r.response_ids += list(out.tokens)
            r.logprobs += list(out.logprobs)
            r.expert_ids = _carry_routing(r, out.expert_ids)
            r.finish_reason = "stop" if out.finish_reason == "stop" else "length"
            r.text = self.tokenizer.decode(r.response_ids, skip_special_tokens=True)
            r.parsed = None
        self._grade(batch)
        groups = []
        for r in batch:
            tree = self.trees[r.problem_uid]
            tree.finished.setdefault(r.stage, []).append(r)
        for uid in dict.fromkeys(r.problem_uid for r in batch):
            groups += self._complete_groups(self.trees[uid], batch)
            self._advance(self.trees[uid])
        return groups

    def _completion(self, rollout: Rollout) -> Completion:
        """A finished rollout as the `Completion` the V-C loop would have received."""
        return Completion(rollout.text, rollout.finish_reason, len(rollout.response_ids),
                          thinking_open=self.thinking_open)

    def _parse(self, rollout: Rollout) -> stages.SolutionOutput | stages.VerificationOutput:
        """A finished rollout's output as its stage parses it (parsed once, kept on the rollout)."""
        if rollout.parsed is None:
            completion = self._completion(rollout)
            rollout.parsed = (stages.parse_verification(completion) if rollout.role == "verifier"
                              else stages.parse_solution(completion))
        return rollout.parsed

    def _grade(self, finished: Sequence[Rollout]) -> None:
        """Rewards and verdicts as `stages` judges the outputs (module docstring, "Grading")."""
        solvers = [r for r in finished if r.role != "verifier"]
        outputs = [self._parse(r) for r in solvers]
        golds = [self.trees[r.problem_uid].problem["answer"] for r in solvers]
        for r, ok in zip(solvers, stages.correct(outputs, golds)):
            r.reward = float(ok) if r.finished_by_itself else self.config.truncated_reward
        for r in finished:
            if r.role == "verifier":
                r.verdict = self._parse(r).verdict
                r.reward = float(r.verdict is not None and r.verdict == bool(r.judged_correct))

    def _complete_groups(self, tree: ProblemTree, finished: Sequence[Rollout]) -> list[list[Rollout]]:
        keys = dict.fromkeys(r.group_key for r in finished if r.problem_uid == tree.uid)
        groups = []
        for key in keys:
            members = [r for r in tree.finished.get(key[1], []) if r.group_key == key]
            if len(members) == self.config.group_size:
                groups.append(members)
        return groups

    def _advance(self, tree: ProblemTree) -> None:
        """Spawns the next stage when the last one is complete; forgets finished trees."""
        stage = max(tree.spawned)
        done = tree.finished.get(stage, [])
        if len(done) < tree.spawned[stage]:
            return
        next_stage = stage + 1
        if next_stage < self.config.max_stages:
            self._spawn_children(tree, done, next_stage)
        if max(tree.spawned) == stage:  # nothing new: the trajectory is over
            del self.trees[tree.uid]

    def _spawn_children(self, tree: ProblemTree, parents: list[Rollout], stage: int) -> None:
        role = STAGE_ROLES[stage]
        # Spawn order, not finishing order: the choice must not depend on the decode schedule.
        parents = sorted(parents, key=lambda r: int(r.uid.rsplit("/", 1)[1]))
        if role == "verifier":  # a solution with no visible text has nothing to judge
            parsed = [(r, self._parse(r)) for r in parents]
            usable = [(r, out) for r, out in parsed
                      if out.usable or (self.config.verify_truncated and out.solution)]
            candidates = [Candidate(is_correct=r.solved) for r, _ in usable]
        else:  # a Verifier output without a verdict (truncated, unreadable): never eligible
            usable = [(r, self._parse(r)) for r in parents]
            candidates = [Candidate(is_correct=bool(r.judged_correct), verdict=r.verdict)
                          for r, _ in usable]
        policy = self.config.selection
        if role == "verifier" and self.config.verifier_selection:
            policy = self.config.verifier_selection
        chosen = select_parents(candidates, stage=role, fan_out=self.config.fan_out,
                                policy=policy,
                                rng=selection_rng(self.seed, tree.uid, stage))
        problem, style = tree.problem["problem"], self.config.prompt_style
        for index in chosen:
            parent, parsed = usable[index]
            try:
                if role == "verifier":
                    ids = self._fit(lambda s: prompts.verifier_messages(problem, s, style),
                                    parsed.solution)
                    extra = dict(solution=parsed.solution, judged_correct=parent.solved)
                else:
                    ids = self._fit(
                        lambda s, rep: prompts.corrector_messages(problem, s, rep, style),
                        parent.solution or "", parsed.report)
                    extra = dict(solution=parent.solution)
            except ContextOverflow as e:
                self._drop(f"{role} of {parent.uid}", e)
                continue
            self._spawn(tree, stage, parent, ids, **extra)

    # --- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """JSON-serialisable state: pending rollouts, trees in flight, counters
        (recorded routing is kept apart, as arrays: `routing`)."""
        def tree_json(t: ProblemTree) -> dict:
            return dict(uid=t.uid, problem=t.problem, spawned={str(k): v for k, v in t.spawned.items()},
                        finished={str(k): [r.to_json() for r in v] for k, v in t.finished.items()})

        return dict(pending=[r.to_json() for r in self.pending],
                    trees=[tree_json(t) for t in self.trees.values()],
                    context_cuts=self.context_cuts,
                    context_drops=self.context_drops)

    def routing(self) -> dict[str, np.ndarray]:
        """Recorded expert ids, by uid, of every rollout still to be trained: the pending ones
        (partial routing) and the finished ones whose group is still incomplete."""
        waiting = []
        for tree in self.trees.values():
            for members in tree.finished.values():
                sizes = collections.Counter(r.group_key for r in members)
                waiting += [r for r in members if sizes[r.group_key] < self.config.group_size]
        return {r.uid: r.expert_ids for r in (*self.pending, *waiting) if r.expert_ids is not None}

    def load_state_dict(self, state: dict, routing: Mapping[str, np.ndarray] | None = None
                        ) -> None:
        """Restores `state_dict()` output, and `routing()` output into the expert ids; reads older
        checkpoints too (a `restarts` counter, no `verdict`s or `context_drops`)."""
        routing = routing or {}

        def rollout(data: dict) -> Rollout:
            r = Rollout(**data)
            r.expert_ids = routing.get(r.uid)
            if "verdict" not in data and r.role == "verifier" and r.finished_by_itself:
                r.verdict = self._parse(r).verdict
            return r

        self.pending = [rollout(r) for r in state["pending"]]
        self.trees = {}
        for t in state["trees"]:
            self.trees[t["uid"]] = ProblemTree(
                uid=t["uid"], problem=t["problem"],
                spawned={int(k): v for k, v in t["spawned"].items()},
                finished={int(k): [rollout(r) for r in v] for k, v in t["finished"].items()})
        self.context_cuts = state["context_cuts"]
        self.context_drops = state.get("context_drops", 0)  # absent in older checkpoints


def _carry_routing(rollout: Rollout, recorded: np.ndarray | None) -> np.ndarray | None:
    """`rollout`'s expert ids after a decode that recorded `recorded` ([L_moe, prompt + response
    so far, k]): positions routed before a continuation keep their routing; None without one."""
    if recorded is None:
        return None
    positions = len(rollout.prompt_ids) + len(rollout.response_ids)
    if recorded.shape[1] != positions:
        raise ValueError(f"rollout {rollout.uid}: routing of {recorded.shape[1]} positions for "
                         f"{positions} tokens")
    known = rollout.expert_ids
    if known is None:
        return recorded
    return np.concatenate([known, recorded[:, known.shape[1]:]], axis=1)

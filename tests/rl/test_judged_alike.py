"""A Verifier reply and a Corrector reply judged alike by the V-C loop (`agents/system.py`, the
evaluation's path, graded by `agents/eval.make_record`) and by RL (`rl/rollout.py`'s reward and
spawning): the same verdict, the same usability, the same prompt for the next agent, and the
reward that judgement implies. Hand-written replies, each ended by itself or cut off by its
budget."""
import pytest

from mars_jax.agents.eval import EvalProblem, make_record
from mars_jax.agents.policy import Completion
from mars_jax.agents.system import LoopConfig, ProblemLoop
from mars_jax.data.tokenizer import encode_chat, eos_token_ids, tiny_tokenizer
from mars_jax.rl.rollout import AgenticRollouts, RolloutConfig
from mars_jax.sampling import EngineOutput

TOKENIZER = tiny_tokenizer()
EOS = eos_token_ids(TOKENIZER)[0]
PROBLEM = {"id": "p0", "problem": "What is 2 + 3?", "answer": "5"}
RIGHT = "<think>2 + 3 is 5</think>\n\n2 + 3 = 5, so \\boxed{5}.\n"
WRONG = "2 + 3 = 6, so \\boxed{6}."
REPORT = "**Final Verdict:** the sum is wrong.\n**List of Findings:** 2 + 3 is not 6.\n"
FOUND = REPORT + "**Correctness:** Wrong"
VERIFIER_REPLIES = [
    FOUND,
    "**Final Verdict:** fine.\n**List of Findings:** None\n**Correctness:** Correct",
    "<think>**Correctness:** Correct</think>\n" + FOUND,  # the verdict after the thought counts
    REPORT,                                                # no verdict
    REPORT + "**Correctness:** maybe",                     # unreadable verdict
    FOUND + "\n<think>on reflection **Correctness:** Correct",  # unclosed thought is not read
    "<think>" + FOUND,                                     # all of it inside an unclosed thought
    "",                                                    # no visible text
]
CORRECTOR_REPLIES = [
    "<think>3 + 2 = 5</think>\n2 + 3 = 5, so \\boxed{5}.",  # fixed
    "2 + 3 = 7, so \\boxed{7}.",                            # still wrong
    "2 + 3 = 5.",                                           # no boxed answer
    "2 + 3 = 5, so \\boxed{5}.<think>or is it 6",          # answer before an unclosed thought
    "<think>2 + 3 = 5, so \\boxed{5}.",                     # all of it inside an unclosed thought
    "<think>so \\boxed{5}</think>",                         # thought only: no visible text
    "",
]
REASONS = ["stop", "length"]


def _ids(text: str, reason: str) -> tuple[int, ...]:
    ids = tuple(TOKENIZER.encode(text, add_special_tokens=False))
    return ids + (EOS,) if reason == "stop" else ids


def _rl(replies):
    """One problem down RL's tree (groups of 1, fan-out 1), stage s decoding `replies[s]` (text,
    finish reason); a cut-off reply fills its role's whole budget. Returns the rollouts and the
    rollout spawned after them (None: the tree ended)."""
    budgets = {"solver": 512, "verifier": 512, "corrector": 512}
    for (text, reason), role in zip(replies, ("solver", "verifier", "corrector")):
        if reason == "length":
            budgets[role] = len(_ids(text, reason))
    rollouts = AgenticRollouts(TOKENIZER, RolloutConfig(
        group_size=1, fan_out=1, selection="adaptive", max_stages=len(replies) + 1,
        max_new_tokens=budgets, max_prompt_tokens=4096, prompt_style="compact"),
        seed=0, encode=encode_chat)
    rollouts.add_problems([PROBLEM], ["t0"])
    done = []
    for text, reason in replies:
        [rollout], rollouts.pending = rollouts.pending, []
        ids = _ids(text, reason)
        assert len(ids) <= budgets[rollout.role]
        rollouts.absorb([rollout], [EngineOutput(list(ids), [-0.5] * len(ids), reason)], 0)
        done.append(rollout)
    assert len(rollouts.pending) <= 1
    return rollouts, done, (rollouts.pending or [None])[0]


def _loop(replies, opened: bool):
    """The V-C loop (one retry-free iteration, accept on one pass) fed `replies`; returns it
    and the request it makes next (None: it finished)."""
    loop = ProblemLoop(PROBLEM["problem"], LoopConfig(
        k_accept=1, max_iterations=1, max_retries=0, prompt_style="compact",
        max_new_tokens={"solver": 512, "verifier": 512, "corrector": 512}))
    for text, reason in replies:
        loop.advance(Completion(text, reason, len(_ids(text, reason)), thinking_open=opened))
    return loop, None if loop.done else loop.next_request()


def _record(loop) -> dict:
    """The evaluation's record of a finished loop (`eval.make_record`: what it counts)."""
    return make_record(EvalProblem("p0", PROBLEM["problem"], PROBLEM["answer"]), 0,
                       loop.result())


def _prompt(request) -> list[int]:
    return encode_chat(TOKENIZER, list(request.messages), enable_thinking=False,
                       add_generation_prompt=True)


@pytest.mark.parametrize("solution", [RIGHT, WRONG])
@pytest.mark.parametrize("reason", REASONS)
@pytest.mark.parametrize("reply", VERIFIER_REPLIES)
def test_a_verifier_reply_is_judged_alike(reply, reason, solution):
    replies = [(solution, "stop"), (reply, reason)]
    rollouts, (solver, verifier), child = _rl(replies)
    loop, request = _loop(replies, rollouts.thinking_open)
    # The loop's verdict, from what it does next: accept (pass), correct (error found), or
    # verify the same candidate again (no verdict).
    verdict = True if loop.done else {"corrector": False, "verifier": None}[request.role]
    assert verifier.verdict is verdict
    # What the evaluation counts the judged solution (a finished loop's Solver-alone grade).
    finished, _ = _loop(replies[:1] + [(FOUND, "stop"), ("", "length")], rollouts.thinking_open)
    right = _record(finished)["solver_correct"]
    assert right == (solution == RIGHT) == verifier.judged_correct
    assert verifier.reward == float(verdict is not None and verdict == right)
    # The Corrector is asked exactly when the loop asks it, with the same prompt.
    if verdict is False:
        assert child is not None and child.prompt_ids == _prompt(request)
    else:
        assert child is None


@pytest.mark.parametrize("reason", REASONS)
@pytest.mark.parametrize("reply", CORRECTOR_REPLIES)
def test_a_corrector_reply_is_judged_alike(reply, reason):
    replies = [(WRONG, "stop"), (FOUND, "stop"), (reply, reason)]
    rollouts, (_, verifier, corrector), child = _rl(replies)
    assert verifier.verdict is False
    loop, request = _loop(replies, rollouts.thinking_open)
    if request is None:  # unusable and no retry left: the loop falls back to the Solver's
        assert loop.result().failure is not None and len(loop.result().candidates) == 1
        assert child is None  # and RL hands it to no Verifier
        assert corrector.reward == 0.0  # truncated_reward (0) or an unusable output's 0
        return
    assert request.role == "verifier"
    assert child is not None and child.prompt_ids == _prompt(request)
    loop.advance(Completion(FOUND, "stop", 1, thinking_open=rollouts.thinking_open))
    assert corrector.reward == float(_record(loop)["candidates"][1]["correct"])

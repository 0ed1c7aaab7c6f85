"""Text hygiene: an output too long for the next agent's context is cut by the overflow rule, not
a crash, and every cut or dropped prompt is counted."""
import collections

from mars_jax.data.tokenizer import encode_chat, eos_token_ids, tiny_tokenizer
from mars_jax.rl.rollout import CUT_MARKER, AgenticRollouts, RolloutConfig
from mars_jax.sampling import EngineOutput
from tests.rl.scripted import decode_all

TOKENIZER = tiny_tokenizer()
EOS = eos_token_ids(TOKENIZER)[0]
MAX_PROMPT = 400
# Far longer than the context allows once embedded in the next agent's prompt.
SCRIPT = {
    "solver": "Let me add. " * 200 + "So 1 + 1 = 3, \\boxed{3}",
    "verifier": ("**Final Verdict:** wrong.\n**List of Findings:** "
                 + "Location: the sum, Issue: Critical Error. " * 40 + "\n**Correctness:** Wrong"),
    "corrector": "1 + 1 = 2, so \\boxed{2}",
}


class LongWindedGenerator:
    """Each role's whole script at once; records every prompt it is asked to continue."""

    def __init__(self):
        self.prompts = collections.defaultdict(list)

    def __call__(self, requests):
        outputs = []
        for r in requests:
            self.prompts[r.role].append(list(r.prompt_ids))
            ids = TOKENIZER.encode(SCRIPT[r.role], add_special_tokens=False) + [EOS]
            outputs.append(EngineOutput(tuple(ids), (-0.5,) * len(ids), "stop"))
        return outputs


def test_overflowing_outputs_are_cut_to_their_tail_and_counted():
    config = RolloutConfig(group_size=2, fan_out=1, selection="random", prompt_style="compact",
                           max_new_tokens={"solver": 4096, "verifier": 4096, "corrector": 4096},
                           max_prompt_tokens=MAX_PROMPT)
    engine = AgenticRollouts(TOKENIZER, config, seed=0, encode=encode_chat)
    problems = iter([
        {"id": "fits", "problem": "What is 1 + 1?", "answer": "2"},
        # The Solver prompt fits, but no Verifier prompt can: its template alone is too long.
        {"id": "verifier-too-long", "problem": "What is 1 + 1? " + "Think. " * 45, "answer": "2"},
        {"id": "solver-too-long", "problem": "What is 1 + 1? " + "Think. " * 80, "answer": "2"},
    ])
    generate = LongWindedGenerator()
    groups, _ = decode_all(engine, problems, generate, count=3)

    stages = collections.Counter((g[0].problem_uid, g[0].stage) for g in groups)
    assert stages == {("1-0", s): 1 for s in range(5)} | {("1-1", 0): 1}
    assert engine.context_drops == 2  # the too-long problem and the Verifier of the other
    assert engine.context_cuts > 0
    assert engine.state_dict()["context_drops"] == 2  # checkpointed with the rest
    for role, prompts in generate.prompts.items():
        assert all(len(p) <= MAX_PROMPT for p in prompts), role
    verifier = TOKENIZER.decode(generate.prompts["verifier"][0])
    corrector = TOKENIZER.decode(generate.prompts["corrector"][0])
    # The rule keeps the tail of the solution, where its final answer is.
    assert CUT_MARKER in verifier and "\\boxed{3}" in verifier
    assert CUT_MARKER in corrector and "Critical Error" in corrector

"""The V-C reasoning system: Solver, Verifier and Corrector played by one policy.

Modules: `policy` (request/completion types, `RoutedPolicy`), `prompts` (chat
prompts, bug report), `stages` (per-stage request builders and parsers),
`system` (the V-C loop and its round-batched driver; the loop rules are
documented there), `eval` (avg@k harness), and two policies: `sampler_policy`
(in-process JAX sampler) and `http_policy` (OpenAI-compatible server).
"""

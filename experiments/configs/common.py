"""Defaults shared by the MarsRL configs; each config file overrides what it needs."""
from ml_collections import ConfigDict, config_dict


def base_config() -> ConfigDict:
    """Every field a run reads, with its default. Sections: data, model, rollout, loss,
    optimizer, learner (the update step), checkpoint, eval, warm_start, sft; mesh."""
    c = ConfigDict()
    c.job = "train"                 # 'train' | 'eval_system' | 'sft'
    c.seed = 0
    c.total_steps = 100
    c.max_nonfinite_updates = 3
    # Seconds from SIGTERM (a preemption notice) to the exit with code 75: loops stop between
    # decode rounds, micro-batches and V-C rounds and save what a rerun resumes from
    # (mars_jax.preemption); a watchdog exits when they run out (or after twice the longest
    # micro-batch measured, where that is longer).
    c.preemption_grace_s = 25.0
    c.tokenizer = "tiny"            # 'tiny' | 'qwen3' | a checkpoint directory
    c.jax_cache_dir = "~/.cache/mars_jax/jax"  # persistent compilation cache ('' = off)
    # (first, last): a jax.profiler trace of those steps of a training run, written under
    # WORKDIR/tensorboard/plugins/profile (TensorBoard's profile tab); () = none.
    # --config.profile_steps=3,4
    c.profile_steps = ()
    # jax_default_matmul_precision: 'default' is JAX's own, which computes float32 matmuls in
    # TF32 on recent GPUs and in bfloat16 passes on TPU; 'float32' computes them in full (as torch
    # does, and as the HF-parity tests check) for a float32 model on GPU / TPU. It reaches the
    # Pallas kernels too, and Mosaic rejects it on bfloat16 operands (the paged KV cache's).
    c.matmul_precision = "default"  # 'default' | 'float32' | 'tensorfloat32' | 'bfloat16'

    # Within-slice axis sizes (-1 = the rest); `dcn` sizes run across slices (TPU multi-slice) or
    # processes (GPU/CPU hosts): e.g. --config.mesh.dcn.data=2 for two slices doing data parallel.
    # mesh.rollout.devices > 0 splits the devices: these axes (no dcn) then lay out the training
    # mesh over the first devices, mesh.rollout's the rollout (engine) mesh over the last
    # `devices`; after each update the weights are copied across (mars_jax.weight_sync).
    c.mesh = ConfigDict(dict(data=-1, fsdp=1, tensor=1, expert=1,
                             dcn=dict(data=1, fsdp=1, tensor=1, expert=1),
                             rollout=dict(devices=0, data=-1, fsdp=1, tensor=1, expert=1)))

    c.data = ConfigDict(dict(name="arith", split="train", manual_dir="", data_dir="", shuffle=True))
    # Difficulty of the generated `arith` problems (mars_jax.data.arith.generate_problems) and
    # the (train, test) split sizes (mars_jax.data.arith.load_split).
    c.data.arith = ConfigDict(dict(num_ops=(1, 3), max_operand=20, operators="+-*",
                                   sizes=(20_000, 500)))

    c.model = ConfigDict(dict(preset="tiny", checkpoint="", dtype="", param_dtype="",
                              moe_impl="", moe_block_size=config_dict.placeholder(int),
                              moe_dense_max_tokens=config_dict.placeholder(int),
                              moe_chunk_tokens=config_dict.placeholder(int),
                              attention_impl="", attention_block=config_dict.placeholder(int),
                              remat=config_dict.placeholder(bool),
                              scan_layers=config_dict.placeholder(bool)))

    c.rollout = ConfigDict(dict(
        mode="pipeline",            # 'pipeline' | 'sequential'
        prompts_per_step=4, group_size=8, fan_out=2,
        selection="adaptive",       # 'random' | 'balanced' | 'adaptive'
        verifier_selection="",      # the Verifier stage's own policy; '' = selection
        max_stages=5, roles_trained="all",  # 'all' (MarsRL) | 'solver' (-S) | 'vc' (-VC)
        max_new_tokens=ConfigDict(dict(solver=256, verifier=256, corrector=256)),
        # The rollout scheduler (mars_jax.rl.streaming) decodes on one engine for the whole run:
        # 'engine' (continuous batching over engine_slots slots) | 'generate' (static batches of
        # at most max_decode_rows rows, 0 = all; either way no more than half the free memory
        # holds, mars_jax.sampling.sampler.static_rows; the exact reference the tests compare
        # the engine against).
        decode_engine="engine",
        max_decode_rows=0,
        engine_slots=0,             # engine slots; 0 = 16
        engine_chunk_steps=16,      # engine decode steps between admissions
        exchange_chunks=1,          # pipeline mode: engine chunks between two exchanges of the
                                    # hosts (more: fewer waits for the slowest host, later agreed
                                    # updates and stops; benchmarks/sim/exchange.py)
        engine_admit_batch=1,       # free slots before queued requests are admitted (one prefill)
        engine_prefill_ahead=0,     # prompts per admission prefill call (queued ones prefilled early)
        engine_kv_pages=0,          # 0: each slot reserves its positions; N: a pool of N KV pages
        engine_page_size=64,        # positions per KV page (with engine_kv_pages)
        engine_paged_attention="auto",  # 'auto' (Pallas kernel on GPU / TPU) | 'gather' | ...
        engine_precompile=False,    # compile the engine's programs at start-up, on a thread pool
        # Each output is graded as it finishes and the next stage submitted at once; an update
        # comes every samples_per_update trained samples (0 = prompts_per_step * group_size).
        samples_per_update=0,
        resume="recompute",         # after an update: 'recompute' | 'keep' the slots' KV
        # Pipeline mode: versions a trained sample may lag its first token.
        staleness_bound=1, max_prompt_tokens=1024,
        # Pipeline mode admits new problems only while fewer rollouts than this are in flight;
        # 0 = mars_jax.rl.streaming.auto_inflight_rows (prompts_per_step problems' trees).
        max_inflight_rows=0,
        # Pipeline mode admits at most this many problems per update (over all hosts); an update
        # then takes what it has, so it comes even when every group's rewards are equal (such
        # groups train nothing). 0 = mars_jax.rl.streaming.auto_problems_per_update.
        max_problems_per_update=0,
        # An output ended by length: Solver / Corrector reward (its text is not graded), and
        # whether it may be a Verifier's parent (a truncated Verifier output earns 0, no verdict).
        truncated_reward=0.0, verify_truncated=False,
        temperature=1.0, top_p=1.0, top_k=0, enable_thinking=False,
        prompt_style="full",        # 'full' | 'compact' (tiny models, byte-level tokenizer)
        # Zero-variance groups: dropped, or (False) kept in the batch with a zero loss mask.
        drop_zero_variance=True, normalize_std=True))

    # 0 switches an optional loss term off (clip_c, behaviour_weight_cap, mastered_mask_prob, ...);
    # target_entropy 0: no entropy gate, the mastered-token mask (if on) applies at every step.
    # pi_old: 'sampler' (the sampler's log-probabilities) | 'recompute' (one forward at the start
    # of the step; the sampler's then weight each token, min(pi_old / pi_sampler, cap)).
    # aggregation: 'seq-mean-token-mean' (the paper's Eq. 2) | 'token-mean' (DAPO) |
    # 'seq-mean-token-sum-norm' (divides by max_response_len). kl_estimator 'k3+': k3's value,
    # the reverse KL's gradient. mask_truncated: outputs that ended by length stay out of the loss.
    c.loss = ConfigDict(dict(clip_low=0.2, clip_high=0.28, clip_c=0.0, kl_coef=0.0,
                             kl_estimator="k3+", aggregation="seq-mean-token-mean",
                             max_response_len=0, pi_old="sampler", behaviour_weight_cap=2.0,
                             mask_truncated=False, mastered_mask_prob=0.0, target_entropy=0.0,
                             entropy_coef=0.0))

    # decay_steps: optimizer updates the cosine schedule decays over (0: the whole run, i.e.
    # total_steps x ppo_epochs x mini_batches; the sft job: sft.steps).
    c.optimizer = ConfigDict(dict(learning_rate=1e-6, schedule="constant", warmup_steps=0,
                                  decay_steps=0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
                                  max_grad_norm=1.0))

    # A step makes ppo_epochs x mini_batches optimizer updates on its samples (mars_jax.rl.learner).
    # pack: a row holds several samples (first fit, longest first; each attends only to itself),
    # so short samples do not each pay a whole row; else one sample a row, longest first. A
    # micro-batch is micro_batch_size rows, cut to the shortest of its width / 2**k,
    # k <= length_halvings, that holds them; fine_cuts adds the 3/4 points (rl.update.cut_lengths).
    # A batch has at least min_length columns and min_micro_batches micro-batches (padding ones
    # skip their forward and backward), so that fewer shapes compile. offload_optimizer: on one
    # shared mesh the optimizer state (and the KL reference parameters) wait in pinned host
    # memory while the engine decodes and return for the update (mars_jax.offload); the engine's
    # KV cache leaves the devices for the update where nothing is lost (no request in a slot, or
    # resume='recompute', which re-prefills them after it).
    c.learner = ConfigDict(dict(ppo_epochs=1, mini_batches=1, micro_batch_size=8, min_length=32,
                                min_micro_batches=1, pack=True,
                                logits_chunk=256, routing_replay=False, length_halvings=2,
                                fine_cuts=False, offload_optimizer=False))

    c.checkpoint = ConfigDict(dict(every_steps=1, keep=3, async_save=True))

    c.eval = ConfigDict(dict(dataset="arith", split="test", num_problems=0, num_samples=1,
                             k_accept=4, max_iterations=10, max_retries=2,
                             # 'most_passed' (the paper's words) | 'most_verified' (the released
                             # extract_solution.py); see mars_jax.agents.system
                             fallback="most_passed",
                             max_new_tokens=ConfigDict(dict(solver=256, verifier=256,
                                                            corrector=256)),
                             temperature=0.6, top_p=0.95, policy="sampler",
                             vc_base_url="", solver_base_url="", served_model="",
                             # the environment variable holding the servers' API key, sent as
                             # a Bearer token when set (never the key itself: the config is
                             # recorded in the workdir); '' = none
                             api_key_env="OPENAI_API_KEY",
                             timeout_s=600.0, max_concurrency=32,
                             engine_slots=0,  # > 0: the sampler policy on an Engine
                             # A train job with probe_every > 0 ('arith' only) samples each
                             # role's decisions (mars_jax.sft.probe) on the first probe_problems
                             # held-out problems at these settings before step 1 and every
                             # probe_every steps: `probe/*` in metrics.jsonl.
                             probe_every=0, probe_problems=256))

    # A train job with `warm_start.sft` starts from an SFT model built on first use by the 'sft'
    # job from this config's data, model, sft and seed, with this learning rate, schedule and
    # warm-up, and cached under cache_dir by a fingerprint of all that (mars_jax.sft.warm_start).
    c.warm_start = ConfigDict(dict(sft=False, cache_dir="~/.cache/mars_jax/warm_start",
                                   learning_rate=2e-3, schedule="cosine", warmup_steps=10))

    # The 'sft' job (mars_jax.sft): packed supervised steps on generated role traces; `keep` is the
    # probability that a problem's example of each role is trained on.
    c.sft = ConfigDict(dict(arch="",   # '' = model.preset; else a mars_jax.sft.job.ARCHS name
                            steps=200, rows=16, row_tokens=512,
                            # stop_at > 0: the job ends after that step, the prefix of a run of
                            # `steps` (its schedule still decays over `steps`).
                            stop_at=0,
                            # short_rows > 0: each batch also has short_rows rows of
                            # short_row_tokens, which take the examples that fit (attention
                            # over short rows costs less); see mars_jax.sft.train.pack.
                            short_rows=0, short_row_tokens=0,
                            solver_error_rate=0.3, verifier_flawed_rate=0.5,
                            keep=ConfigDict(dict(solver=1.0, verifier=1.0, corrector=1.0)),
                            holdout_problems=64, eval_every=50,
                            # probe_every > 0: each role's decisions sampled on the held-out
                            # problems (mars_jax.sft.probe) on an engine of probe_slots slots.
                            probe_every=0, probe_slots=64))
    return c

"""AOT compilation of the step programs for TPU topologies (libtpu, compile-only devices).

The tests that compile need `pip install -e .[tpu]`: without libtpu they skip, except in CI (env
`CI` set), where they fail. The tiny preset compiles in about 30 s; the bench ones are slow.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from mars_jax import sharding
from mars_jax.models import Qwen3, get_preset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))
sys.path.insert(0, str(ROOT / "experiments" / "configs"))
import aot_compile  # noqa: E402
import marsrl_qwen3_30b_a3b  # noqa: E402

# The bench preset (8 layers, 16 experts) at short lengths.
# Both on static batches (the step programs, `aot_compile.PROGRAMS`) unless a test names the engine.
BENCH = ["--config=experiments/configs/smoke.py", "--config.model.preset=bench",
         "--config.rollout.decode_engine=generate",
         "--config.rollout.max_prompt_tokens=64", "--config.learner.micro_batch_size=8"] + [
    f"--config.rollout.max_new_tokens.{role}=64" for role in ("solver", "verifier", "corrector")]
# The tiny preset at short lengths: every program compiles in seconds.
TINY = ["--config=experiments/configs/smoke.py", "--config.rollout.decode_engine=generate",
        "--config.rollout.max_prompt_tokens=64", "--config.learner.micro_batch_size=8"] + [
    f"--config.rollout.max_new_tokens.{role}=32" for role in ("solver", "verifier", "corrector")]


@pytest.fixture
def libtpu():
    """Skips without libtpu, or fails when the environment says this is CI."""
    if importlib.util.find_spec("libtpu") is None:
        message = "libtpu is not installed: pip install -e .[tpu]"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"{message} (CI={os.environ['CI']}: CI must run the AOT tests)")
        pytest.skip(message)


needs_libtpu = pytest.mark.usefixtures("libtpu")


def _aot(tmp_path: Path, *args: str, env: dict[str, str] | None = None
         ) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "aot.json"
    result = subprocess.run([sys.executable, "experiments/aot_compile.py", f"--json={out}", *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=3600,
                            env={**os.environ, **(env or {})})
    assert out.exists(), result.stderr[-4000:]
    return result, json.loads(out.read_text())


def test_paper_shapes():
    shapes = aot_compile.step_shapes(marsrl_qwen3_30b_a3b.get_config())
    assert (shapes.decode_batch, shapes.prompt_len, shapes.new_tokens) == (1024, 32768, 65536)
    # One mini-batch of the step's 1,024 rows: 4 mini-batches of 256 rows, two micro-batches of
    # 128 (one row per training chip of v5p-512) each, all of them on one host.
    assert (shapes.micro_batch, shapes.num_micro, shapes.train_len) == (128, 2, 131072)
    assert shapes.host_micro_batch == 128


@needs_libtpu
@pytest.mark.parametrize("topology, host_rows", [("v5p:8x8x4", 2), ("v5p:4x4x4", 8)])
def test_the_30b_micro_batch_counts_the_rows_of_all_hosts(topology, host_rows):
    """128 rows per micro-batch on any slice: on v5p:8x8x4 (64 hosts, 2 training chips each)
    2 rows a host, one per training chip; on v5p:4x4x4 (16 hosts) 8 rows a host."""
    config = marsrl_qwen3_30b_a3b.get_config()
    train_mesh, _ = sharding.make_meshes(config.mesh.to_dict(),
                                         aot_compile.make_target(topology).devices)
    shapes = aot_compile.step_shapes(config, train_mesh)
    assert (shapes.micro_batch, shapes.host_micro_batch) == (128, host_rows)


@needs_libtpu
def test_a_micro_batch_the_hosts_cannot_share_is_refused_before_compiling():
    config = marsrl_qwen3_30b_a3b.get_config()
    config.learner.micro_batch_size = 24  # v5p:4x4x4 has 16 hosts
    with pytest.raises(aot_compile.ConfigError, match=r"learner.micro_batch_size: 24 rows .* "
                       r"not split evenly over 16 processes"):
        aot_compile.run(config, "v5p:4x4x4")


def test_shapes_follow_the_sampler_bucket_and_the_learner_minimums():
    config = marsrl_qwen3_30b_a3b.get_config()
    config.rollout.prompts_per_step, config.rollout.group_size = 5, 8  # 40 rows: bucket 64
    config.learner.min_micro_batches, config.learner.min_length = 4, 262144
    shapes = aot_compile.step_shapes(config)
    assert (shapes.decode_batch, shapes.num_micro, shapes.train_len) == (64, 4, 262144)


@needs_libtpu
def test_an_invalid_config_is_refused_before_compiling(tmp_path):
    result = subprocess.run([sys.executable, "experiments/aot_compile.py", "--topology=v5e:2x2",
                             *TINY, "--config.rollout.mode=pipelined"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "rollout.mode" in result.stderr


@needs_libtpu
def test_tiny_step_programs_compile_for_a_small_tpu_slice(tmp_path):
    result, report = _aot(tmp_path, "--topology=v5e:2x2", *TINY)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert report["target"].startswith("v5e:2x2") and report["mesh"]["data"] == 4
    results = {r["program"]: r for r in report["results"]}
    assert list(results) == ["prefill", "decode", "logprobs", "micro_batch_gradients",
                             "apply_gradients"]
    for r in results.values():
        assert r["fits"] and not r["error"] and r["argument_bytes"] > 0 and r["flops"] > 0, r
        assert r["total_bytes"] <= report["hbm_bytes"]
    # Replicated over data=4. Beside a micro-batch's gradient the trainer holds Adam's two
    # moments (2 x the parameters); the gradient sum is updated in place, and applying it
    # rewrites the donated parameters and both moments in place (3 x the gradient sum, in the
    # chip's padded layouts).
    shapes = jax.eval_shape(lambda: nnx.state(Qwen3(get_preset("tiny"), rngs=nnx.Rngs(0))))
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    forward = results["logprobs"]
    gradients, apply = results["micro_batch_gradients"], results["apply_gradients"]
    assert gradients["resident_bytes"] == pytest.approx(2 * param_bytes, rel=0.01)
    assert apply["resident_bytes"] == 0  # no KL term: no reference parameters
    assert apply["alias_bytes"] == pytest.approx(3 * gradients["alias_bytes"], rel=0.01)
    # One micro-batch's backward pass costs at least twice its forward.
    assert gradients["flops"] >= 3 * forward["flops"]


@needs_libtpu
def test_tiny_engine_programs_write_the_sharded_slot_state_in_place(tmp_path):
    """8 slots of 96 positions over data=4 (2 per chip). The KV bytes the report gives are the
    cache that XLA's memory analysis finds in the decode chunk's arguments, donated through;
    the insert's temporaries stay below two prompt rows (gathering the batch-sharded prompt cache
    for the row, as the first insert did, takes 8 of them); shrinking to 4 slots outputs half the
    per-chip state (not all 4 slots on every chip) and expanding back updates the state in
    place."""
    result, report = _aot(tmp_path, "--topology=v5e:2x2", *TINY,
                          "--config.rollout.decode_engine=engine",
                          "--config.rollout.engine_slots=8",
                          "--programs=engine_insert,engine_decode,engine_shrink,engine_expand")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    r = {x["program"]: x for x in report["results"]}
    kv = report["kv_bytes"]
    cfg = get_preset("tiny")
    assert kv["per_token"] == (2 * cfg.num_hidden_layers * cfg.num_key_value_heads
                               * cfg.head_dim * 4)  # float32 keys and values of every layer
    assert (kv["slots"], kv["positions"]) == (8, 64 + 32)
    assert kv["per_slot"] == kv["per_token"] * 96 and kv["per_device"] == 2 * kv["per_slot"]
    assert "bytes per token" in result.stdout and "per slot" in result.stdout
    decode = r["engine_decode"]
    assert kv["per_device"] <= decode["alias_bytes"] <= decode["argument_bytes"]
    prompt_row = kv["per_token"] * 64
    insert = r["engine_insert"]
    assert insert["alias_bytes"] >= kv["per_device"] and insert["temp_bytes"] < 2 * prompt_row
    expand = r["engine_expand"]
    assert expand["alias_bytes"] >= kv["per_device"]  # the full state donated through
    assert r["engine_shrink"]["output_bytes"] <= 0.55 * expand["output_bytes"]


@needs_libtpu
@pytest.mark.parametrize("mesh, pools, per_device", [
    (("--config.mesh.data=1", "--config.mesh.tensor=-1"), 1, 2),  # the 2 KV heads split
    (("--config.mesh.data=-1",), 4, 4),                            # a pool per chip
])
def test_tiny_paged_engine_programs_keep_a_pool_per_batch_shard(tmp_path, mesh, pools,
                                                               per_device):
    """8 slots over 2,000 pages of 16 positions on v5e:2x2: the report's KV bytes are the
    pools', (2,000 + one trash page per pool) x 16 positions, spread over the chips; the
    insert and the decode chunk take the pools donated, and neither copies them (temporaries
    under a quarter of a chip's pages: no pool is gathered). Layers scanned: unrolled over the
    pools of every layer, XLA:TPU lays the gather path's pools out otherwise in the chunk's
    loop (at this head_dim of 16) and copies them in and out (3.1 of 8.2 MB on the first
    mesh)."""
    result, report = _aot(tmp_path, "--topology=v5e:2x2", *TINY, "--config.model.scan_layers=True",
                          "--config.rollout.decode_engine=engine",
                          "--config.rollout.engine_slots=8",
                          "--config.rollout.engine_kv_pages=2000",
                          "--config.rollout.engine_page_size=16", *mesh,
                          "--programs=engine_insert,engine_decode")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    kv = report["kv_bytes"]
    assert kv["total"] == kv["per_token"] * (2000 + pools) * 16
    assert kv["per_device"] == kv["total"] // per_device
    assert "over 2000 pages" in result.stdout
    for r in report["results"]:
        assert r["alias_bytes"] >= kv["per_device"], r["program"]
        assert r["temp_bytes"] < kv["per_device"] / 4, r["program"]


@needs_libtpu
@pytest.mark.parametrize("scan", [False, True])
def test_the_tpu_paged_decode_updates_the_pool_in_place(tmp_path, scan):
    """Two dense layers with the 30B's attention shapes (4 KV heads of 128, bf16), 64 slots
    over 2,048 pages of 64 on v5p:2x2x1 (a pool per chip): the Pallas TPU kernel reads the pages
    where the chunk writes them, layers unrolled or scanned, so the decode chunk's temporaries
    stay under half the KV a chip holds (a pool written in a layout other than the kernel's was
    re-laid out for it at every layer: 0.10 of 0.13 GiB here, 49 of 12 GiB at the paper's 48
    layers)."""
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(dict(
        model_type="qwen3", vocab_size=512, hidden_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=128, intermediate_size=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=True)))
    result, report = _aot(tmp_path, "--topology=v5p:2x2x1", *TINY,
                          f"--config.model.checkpoint={checkpoint}",
                          "--config.model.dtype=bfloat16", f"--config.model.scan_layers={scan}",
                          "--config.rollout.decode_engine=engine",
                          "--config.rollout.engine_slots=64",
                          "--config.rollout.engine_kv_pages=2048",
                          "--config.rollout.engine_page_size=64", "--programs=engine_decode")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "(paged attention: tpu)" in result.stdout
    kv = report["kv_bytes"]
    assert kv["per_device"] == 2 * 2 * 4 * 128 * 2 * (2048 + 4) * 64 // 4
    [decode] = report["results"]
    assert decode["alias_bytes"] >= kv["per_device"]
    assert decode["temp_bytes"] < kv["per_device"] / 2


@pytest.mark.slow  # ~70 s of compiling at load 22 on 2 cores
@needs_libtpu
def test_the_scanned_tpu_decode_reads_the_expert_weights_as_stored(tmp_path):
    """Four scanned MoE layers (8 experts of 128 hidden units, bf16), decode on v5p:2x2x1 with
    the experts split over 2 chips: the grouped matmul (Pallas megablox) reads `wi` out-by-in as
    stored, so no copy of the stacked `wi` is made (XLA's `ragged_dot` wanted it in-by-out and
    re-laid out every layer's at once before the layer loop: 0.375 GiB a layer a chip at the
    paper's shapes, launch/README.md)."""
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(dict(
        model_type="qwen3_moe", vocab_size=512, hidden_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, intermediate_size=256,
        moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=True)))
    dump = tmp_path / "hlo"
    result, _ = _aot(tmp_path, "--topology=v5p:2x2x1", *TINY,
                     f"--config.model.checkpoint={checkpoint}", "--config.model.dtype=bfloat16",
                     "--config.model.param_dtype=bfloat16", "--config.model.scan_layers=True",
                     "--config.mesh.rollout.data=-1", "--config.mesh.rollout.expert=2",
                     "--config.rollout.decode_engine=engine",
                     "--config.rollout.engine_slots=64", "--config.rollout.engine_kv_pages=256",
                     "--config.rollout.engine_page_size=64", "--programs=engine_decode",
                     env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text "
                                       "--xla_dump_hlo_module_re=.*decode_chunk.*"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    [hlo] = dump.glob("*decode_chunk*.after_optimizations.txt")
    # The stacked wi a chip holds: 4 layers x 4 of the 8 experts x (gate, up) x 128 x 256.
    stacked = re.findall(r"= bf16\[4,4,2,128,256\]\S* (\w[\w-]*)\(", hlo.read_text())
    # Only passed along (as the program's argument, into and out of loops), never copied.
    assert stacked and set(stacked) <= {"parameter", "get-tuple-element"}, stacked


@pytest.mark.slow  # a Qwen3-30B-A3B layer: ~40 s of compiling
@needs_libtpu
def test_paged_decode_compiles_the_tpu_kernel_for_the_30b_attention(tmp_path):
    """One layer of Qwen3-30B-A3B (head_dim 128, 32 query / 4 KV heads) on v5p:2x2x1, 8 slots
    over 64 pages of 64 positions: 'auto' picks the Pallas TPU paged-attention kernel, which
    compiles inside the decode chunk (on each batch shard's rows and pool)."""
    result, _ = _aot(tmp_path, "--topology=v5p:2x2x1",
                     "--config=experiments/configs/marsrl_qwen3_30b_a3b.py", "--num_layers=1",
                     "--config.mesh.rollout.devices=0", "--config.mesh.rollout.data=-1",
                     "--config.mesh.rollout.expert=1",
                     "--config.rollout.decode_engine=engine", "--config.rollout.engine_slots=8",
                     "--config.rollout.max_prompt_tokens=128",
                     *(f"--config.rollout.max_new_tokens.{role}=128"
                       for role in ("solver", "verifier", "corrector")),
                     "--config.rollout.engine_kv_pages=64", "--config.rollout.engine_page_size=64",
                     "--programs=engine_decode")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "(paged attention: tpu)" in result.stdout


@pytest.mark.slow  # a Qwen3-30B-A3B layer: ~40 s of compiling
@needs_libtpu
def test_30b_decode_on_fsdp_gathers_tokens_not_experts(tmp_path):
    """One layer of Qwen3-30B-A3B on v5p:2x2x1 laid out fsdp=4 (32 experts a chip), 128 engine
    slots: above `moe_dense_max_tokens` (64) 'auto' runs `ragged`, and the decode XLA:TPU
    compiles all-gathers the 128 rows' tokens but no expert weight (nothing with the experts'
    768 hidden units)."""
    dump = tmp_path / "hlo"
    result, _ = _aot(tmp_path, "--topology=v5p:2x2x1",
                     "--config=experiments/configs/marsrl_qwen3_30b_a3b.py", "--num_layers=1",
                     "--config.mesh.data=1", "--config.mesh.fsdp=4",
                     "--config.mesh.rollout.devices=0", "--config.mesh.rollout.data=-1",
                     "--config.mesh.rollout.expert=1",
                     "--config.rollout.decode_engine=engine", "--config.rollout.engine_slots=128",
                     "--config.rollout.max_prompt_tokens=128",
                     *(f"--config.rollout.max_new_tokens.{role}=128"
                       for role in ("solver", "verifier", "corrector")),
                     "--programs=engine_decode",
                     env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    [hlo] = dump.glob("*decode_chunk*.after_optimizations.txt")
    gathered = re.findall(r"= (\w+\[[\d,]*\])\S* all-gather\(", hlo.read_text())
    assert "bf16[128,1,2048]" in gathered, gathered
    assert not [shape for shape in gathered if "768" in shape], gathered


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
def test_bench_step_programs_compile(tmp_path, topology):
    result, report = _aot(tmp_path, f"--topology={topology}", *BENCH)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert [r["program"] for r in report["results"]] == list(
        aot_compile.expand_programs(aot_compile.PROGRAMS))
    for r in report["results"]:
        assert r["fits"] and r["argument_bytes"] > 0 and r["flops"] > 0, r
        assert r["total_bytes"] <= report["hbm_bytes"]
    assert "micro_batch_gradients" in result.stdout and "fits" in result.stdout  # the table


@pytest.mark.slow
@needs_libtpu
def test_oversized_configuration_does_not_fit(tmp_path):
    result, report = _aot(tmp_path, "--topology=v5e:2x2", "--programs=prefill", *BENCH,
                          "--config.rollout.prompts_per_step=512",
                          "--config.rollout.max_prompt_tokens=16384")
    assert result.returncode == 1
    [prefill] = report["results"]
    assert not prefill["fits"]
    assert "does not fit: prefill" in result.stdout


def test_a_merged_report_keeps_the_programs_compiled_before_and_refuses_another_target():
    shapes = aot_compile.Shapes(decode_batch=8, prompt_len=64, new_tokens=32, micro_batch=8,
                                host_micro_batch=4, num_micro=2, train_len=128)

    def report(target, *programs, kv=None):
        results = [aot_compile.Result(p, True, temp_bytes=i) for i, p in enumerate(programs)]
        return aot_compile.Report(target, {"data": 4}, "tiny", 2, shapes, 16, results, kv)

    earlier = report("v5e:2x2", "engine_decode", "micro_batch_gradients",
                     kv={"per_token": 3}).to_dict()
    merged = aot_compile.merged_report(earlier, report("v5e:2x2", "micro_batch_gradients",
                                                       "apply_gradients"))
    assert [(r["program"], r["temp_bytes"]) for r in merged["results"]] == [
        ("engine_decode", 0), ("micro_batch_gradients", 0), ("apply_gradients", 1)]
    assert merged["kv_bytes"] == {"per_token": 3}
    with pytest.raises(ValueError, match=r"differs in \['target'\]"):
        aot_compile.merged_report(earlier, report("v5p:2x2x1", "apply_gradients"))


@needs_libtpu
def test_multislice_mesh_keeps_slices_together():
    target = aot_compile.make_target("v5e:2x2", num_slices=2)
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "dcn": {"data": 2}}, target.devices)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}
    assert [{d.slice_index for d in row.flat} for row in mesh.devices] == [{0}, {1}]


@needs_libtpu
def test_tiny_split_compiles_the_engine_on_the_rollout_submesh_and_the_update_on_the_other(
        tmp_path):
    """v5e:2x2 split 2:2: the engine's programs on the rollout pair, logprobs and update on the
    training pair; one weight copy writes the tiny model's f32 parameters once per rollout chip
    (replicated there: data=2)."""
    result, report = _aot(tmp_path, "--topology=v5e:2x2", *TINY,
                          "--config.rollout.decode_engine=engine",
                          "--config.mesh.rollout.devices=2")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert report["mesh"]["data"] == 2 and report["rollout_mesh"]["data"] == 2
    meshes = {r["program"]: r["mesh"] for r in report["results"]}
    assert meshes == {"engine_prefill": "rollout", "engine_insert": "rollout",
                      "engine_decode": "rollout", "logprobs": "train",
                      "micro_batch_gradients": "train", "apply_gradients": "train"}
    for r in report["results"]:
        assert r["fits"] and not r["error"] and r["argument_bytes"] > 0, r
    shapes = jax.eval_shape(lambda: nnx.state(Qwen3(get_preset("tiny"), rngs=nnx.Rngs(0))))
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    assert report["weight_copy_bytes"] == 2 * param_bytes
    assert report["weight_copy_bytes_per_device"] == param_bytes
    assert "one weight copy writes" in result.stdout

"""The cached warm start: keyed by what trains it, built once, reused, never read half-built."""
from experiments.configs import quickstart
from mars_jax.sft import warm_start


def test_fingerprint_follows_the_fields_that_train_the_warm_start():
    base = quickstart.get_config()
    same = quickstart.get_config()
    same.optimizer.learning_rate = 0.5      # the RL learning rate: replaced by warm_start's
    same.rollout.group_size = 3             # rollouts do not train the warm start
    same.warm_start.cache_dir = "/elsewhere"
    same.sft.eval_every, same.sft.probe_every, same.sft.probe_slots = 3, 5, 2  # logs, probes
    same.optimizer.decay_steps = 99         # the job decays over sft.steps
    same.model.preset = "bench"             # the architecture is sft.arch's
    assert base.sft.arch
    assert warm_start.fingerprint(same) == warm_start.fingerprint(base)
    for field, value in [("sft.steps", 7), ("sft.stop_at", 3), ("warm_start.learning_rate", 0.5),
                         ("seed", 1),
                         ("data.arith.max_operand", 8), ("optimizer.b2", 0.9),
                         ("sft.arch", "toy"), ("rollout.prompt_style", "full")]:
        changed = quickstart.get_config()
        *path, key = field.split(".")
        node = changed
        for part in path:
            node = node[part]
        node[key] = value
        assert warm_start.fingerprint(changed) != warm_start.fingerprint(base), field


def test_sft_config_trains_with_the_warm_start_optimizer():
    config = quickstart.get_config()
    sft = warm_start.sft_config(config)
    assert sft.job == "sft" and sft.model.checkpoint == ""
    assert sft.optimizer.learning_rate == config.warm_start.learning_rate
    assert sft.optimizer.schedule == config.warm_start.schedule
    assert config.job == "train"  # the run's own config is left as it was


def test_ensure_builds_once_then_reuses(tmp_path, monkeypatch):
    builds = []

    def fake_sft(config, workdir):  # stands in for the SFT job: writes what it would
        builds.append(workdir)
        model = warm_start.Path(workdir) / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")
        return {"loss": 0.5, "loss/solver": 0.25}

    monkeypatch.setattr(warm_start.sft_job, "run", fake_sft)
    config = quickstart.get_config()
    config.warm_start.cache_dir = str(tmp_path / "cache")
    prefix = f"{warm_start.fingerprint(config)}.tmp.{warm_start.socket.gethostname()}."
    killed, running = (tmp_path / "cache" / f"{prefix}{pid}" for pid in (11, 22))
    for build in (killed, running):
        build.mkdir(parents=True)
    monkeypatch.setattr(warm_start, "_alive", lambda pid: pid == "22")
    first = warm_start.ensure(config)
    assert first == tmp_path / "cache" / warm_start.fingerprint(config) / "model"
    assert (first / "config.json").exists()
    assert builds and builds[0] != str(first.parent)  # built elsewhere, then renamed into place
    assert not killed.exists() and running.exists()  # a dead build is cleared, a live one kept
    assert warm_start.ensure(config) == first and len(builds) == 1
    config.sft.steps += 1
    assert warm_start.ensure(config) != first and len(builds) == 2


def test_fingerprint_follows_the_chat_template(monkeypatch):
    config = quickstart.get_config()
    base = warm_start.fingerprint(config)

    class Templated:
        chat_template = "{{ messages }}"

    monkeypatch.setattr(warm_start.builders, "build_tokenizer", lambda c: Templated())
    assert warm_start.fingerprint(config) != base


def test_alive_knows_this_process_and_a_finished_one():
    import os
    import subprocess
    import sys
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    assert warm_start._alive(str(os.getpid())) and not warm_start._alive(finished)


def test_a_gcs_cache_is_built_once_and_copied_down_on_another_machine(tmp_path, monkeypatch):
    """A gs:// cache_dir (local fake GCS server): the first machine builds and copies the build
    up; a machine with an empty local mirror copies it down instead of building."""
    from mars_jax import storage
    from tests import fake_gcs
    builds = []

    def fake_sft(config, workdir):
        builds.append(workdir)
        model = warm_start.Path(workdir) / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text('{"built": 1}')
        (model / "model.safetensors").write_bytes(b"\x01\x02")
        return {"loss/solver": 0.25}

    monkeypatch.setattr(warm_start.sft_job, "run", fake_sft)
    with fake_gcs.bucket(monkeypatch) as root:
        config = quickstart.get_config()
        config.warm_start.cache_dir = f"{root}/warm"
        shared = storage.path(f"{root}/warm/{warm_start.fingerprint(config)}")
        monkeypatch.setattr(warm_start, "MIRROR", str(tmp_path / "first"))
        first = warm_start.ensure(config)
        assert first == tmp_path / "first" / warm_start.fingerprint(config) / "model"
        assert len(builds) == 1 and (shared / warm_start.COMPLETE).exists()
        assert (shared / "model" / "model.safetensors").read_bytes() == b"\x01\x02"
        monkeypatch.setattr(warm_start, "MIRROR", str(tmp_path / "second"))  # another machine
        second = warm_start.ensure(config)
        assert len(builds) == 1 and second.parent.parent == tmp_path / "second"
        assert (second / "model.safetensors").read_bytes() == b"\x01\x02"
        assert (second / "config.json").read_text() == '{"built": 1}'
        assert not (second.parent / warm_start.COMPLETE).exists()
        assert warm_start.ensure(config) == second and len(builds) == 1

"""The engine configuration: built once from a profile, sent to the engine worker as it is, refused by key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qwen4exp.config import load_settings
from qwen4exp.engine.engine_config import EngineConfig
from qwen4exp.model_dir import EMBEDDED_MODEL

MiB = 1 << 20


def test_the_tiny_profile_is_the_engine_it_describes():
    config = EngineConfig.from_settings(load_settings("tiny", env={}))
    assert config == EngineConfig(model=str(EMBEDDED_MODEL), device="cpu", dtype="float32", slots=4, max_ctx=4096,
                                  chunk=64, restore_spacing=64, prefix_cache=True, prefix_cache_limit=64 * MiB,
                                  device_memory_limit=None, queue_limit=64, cuda_graphs=True, compile_decode=False,
                                  decode_beside_prompts=False, ple="auto")


def test_decode_beside_prompts_goes_from_the_profile_to_the_engine(tiny_checkpoint):
    from qwen4exp.config import ConfigError
    from qwen4exp.engine.engine import Engine
    from qwen4exp.engine.loading import load_model

    config = EngineConfig.from_settings(load_settings("tiny", env={"QWEN4EXP_DECODE_BESIDE_PROMPTS": "true"}))
    assert config.decode_beside_prompts is True
    model = load_model(str(tiny_checkpoint), dtype="float32", device="cpu", progress=False)
    assert Engine.from_config(model, config, context=256).decode_beside_prompts is True
    with pytest.raises(ConfigError, match="decode_beside_prompts"):
        load_settings("tiny", env={"QWEN4EXP_DECODE_BESIDE_PROMPTS": "sometimes"})


def test_a_gpu_profile_takes_the_automatic_chunk_and_its_devices_limit(tmp_path):
    profile = tmp_path / "gpu.toml"
    profile.write_text('model = "tiny"\nmax_ctx = "auto"\ndevice_memory_limit = "100GiB"\n'
                       '[[devices]]\nname = "cuda"\nrole = "target"\nmemory_limit = "30GiB"\n'
                       '[prefix_cache]\nresident_limit = "auto"\n[server]\nqueue_limit = 9\n')
    config = EngineConfig.from_settings(load_settings(profile, env={}))
    assert (config.device, config.chunk, config.spacing, config.max_ctx) == ("cuda:0", 2048, 2048, "auto")
    assert config.device_memory_limit == 30 << 30 and config.prefix_cache_limit == "auto" and config.queue_limit == 9


def test_the_daemon_sends_it_to_the_worker_without_importing_torch():
    """The daemon's process (the app, the supervisor, the config built from a profile and pickled for the worker)
    never imports torch: its start and its request-preparing processes stay light."""
    code = ("import pickle, sys\n"
            "from qwen4exp.config import load_settings\n"
            "from qwen4exp.engine.engine_config import EngineConfig\n"
            "import qwen4exp.server.app\n"
            "config = EngineConfig.from_settings(load_settings('tiny', env={}))\n"
            "assert pickle.loads(pickle.dumps(config)) == config\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("changes, key", [
    ({"slots": 17}, "slots"),
    ({"slots": True}, "slots"),
    ({"chunk": 0}, "chunk"),
    ({"max_ctx": "big"}, "max_ctx"),
    ({"dtype": "int8"}, "dtype"),
    ({"prefix_cache_limit": -1}, "prefix_cache_limit"),
    ({"device_memory_limit": 0}, "device_memory_limit"),
    ({"cuda_graphs": "yes"}, "cuda_graphs"),
    ({"ple": "gpu"}, "ple"),
])
def test_a_bad_value_is_refused_naming_its_key(changes, key):
    with pytest.raises(ValueError, match=rf"engine setting {key} must be"):
        EngineConfig(**changes)


def test_an_automatic_context_must_be_resolved_before_the_engine_is_built(tiny_checkpoint):
    from qwen4exp.engine.engine import Engine

    config = EngineConfig(model=str(tiny_checkpoint), device="cpu", dtype="float32", slots=2, max_ctx="auto", chunk=32)
    _, model = config.load_model()
    with pytest.raises(ValueError, match="max_ctx is 'auto': resolve the context first"):
        Engine.from_config(model, config)
    engine = Engine.from_config(model, config, context=256)
    assert (len(engine.pool.slots), engine.context, engine.chunk) == (2, 256, 32)


def quantized_table_model(tmp_path, mix: str = "IQ4_NL", ple_on_host: bool = False):
    """A tiny GGUF whose PLE table is kept quantized (32 values a head), loaded on the CPU."""
    import torch

    from qwen4exp.checkpoint.presets import preset_config
    from qwen4exp.checkpoint.random_weights import fill_random
    from qwen4exp.engine.loading import build_model, load_model
    from qwen4exp.engine.model.config import ModelConfig
    from test_gguf import write_tiny

    text = dict(preset_config("tiny", dtype="float32")["text_config"], ple_embed_dim=512)
    model = build_model(ModelConfig.from_dict(text), torch.float32, torch.device("cpu"))
    fill_random(model, text, seed=0, dtype=torch.float32)
    path = write_tiny(tmp_path / "table.gguf", mix, model=model, text=text)
    return path, load_model(str(path), dtype="float32", device="cpu", progress=False, ple_on_host=ple_on_host)


def test_ple_auto_moves_a_quantized_table_to_the_host_when_that_fits_a_longer_context(tmp_path, monkeypatch):
    """The decision alone (the GPU suite runs the table from host memory): with the table on the GPU the fit falls
    short of the trained context, with it on the host it fits more, so auto moves it and says so."""
    import torch

    from qwen4exp.engine import fit
    from qwen4exp.engine.loading import quantized_ple_tables

    _, model = quantized_table_model(tmp_path)
    (table,) = quantized_ple_tables(model)

    def fitted(value, model, **settings):      # a GPU's fit: room for more positions once the table left it
        result = fit.FitResult(context=16384 if table.host else 8192, chunk=512, plan=None, seconds=0.0)
        return fit.ContextChoice(result.context, result)

    monkeypatch.setattr(fit, "resolve_max_ctx", fitted)
    monkeypatch.setattr(EngineConfig, "fit_settings", lambda self, device: {})
    gpu = torch.device("cuda", 0)
    assert EngineConfig(ple="device").resolve_context(model, gpu).context == 8192 and not table.host
    choice = EngineConfig(ple="auto").resolve_context(model, gpu)
    assert choice.context == 16384 and table.host
    assert any("PLE table" in note and "16384" in note for note in choice.fit.notes)


def test_a_table_the_fit_moved_to_the_host_stays_there_after_an_unpark_and_in_a_restarted_worker(tmp_path,
                                                                                                   monkeypatch):
    """The context fitted with `ple = "auto"`'s table in host memory is kept by an unpark (release level) and by
    a worker started after a crash, neither of which fits again: both must load the table into host memory
    again, or they would serve a context the device cannot hold."""
    from qwen4exp.engine import fit
    from qwen4exp.engine.loading import quantized_ple_tables
    from qwen4exp.server.messages import ParkLevel
    from qwen4exp.server.worker import Worker
    from restarted_worker import next_worker_config

    path, _ = quantized_table_model(tmp_path)

    def fit_moving_the_table(self, model, device, **overrides):       # what a GPU's fit does (see above)
        for table in quantized_ple_tables(model):
            table.keep_on_host()
        return fit.ContextChoice(256, None)

    monkeypatch.setattr(EngineConfig, "resolve_context", fit_moving_the_table)
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", slots=1, max_ctx="auto", chunk=32,
                          prefix_cache=False, ple="auto")
    worker = Worker(config, conn=None)
    info = worker.load()
    assert info["context"] == 256 and info["ple"] == "host"
    worker.park(ParkLevel.RELEASE)
    monkeypatch.setattr(EngineConfig, "resolve_context", lambda *a, **k: pytest.fail("a kept context is refitted"))
    assert worker.load()["context"] == 256
    assert all(table.host for table in quantized_ple_tables(worker.engine.model))
    worker.park(ParkLevel.RELEASE)

    assert next_worker_config(config, info).ple == "host"           # what the next worker is started with

"""The serving engine on a CUDA/ROCm device: the decode step replayed from a CUDA graph (torch.compile'd or not)
gives every request the numbers it gets alone, the same as without the graph, warm or cold (float32, bfloat16,
and bfloat16 with a GGUF's quantized weights), and the float32 engine follows the reference's greedy ids. Run on a
GPU host with `pytest -m gpu`."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from qwen4exp.engine.engine import Engine
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.prefix_cache import PrefixCache
from qwen4exp.engine.sampling import SamplingParams
from qwen4exp.engine.snapshot import SnapshotBackend
from logits_record import assert_same_logits, record_logits
from staggered import run_staggered

pytestmark = pytest.mark.gpu
DTYPES = ("float32", "bfloat16")
GGUF = "bfloat16 from a UD-Q4_K_XL GGUF"     # experts and the PLE table kept as blocks (kernels/moe_blocks.py)
NAMES = DTYPES + (GGUF,)
CONTEXT, CHUNK = 512, 16
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def models(tiny_checkpoint, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    torch.backends.cuda.matmul.allow_tf32 = False
    models = {name: load_model(str(tiny_checkpoint), dtype=name, device="cuda", progress=False) for name in DTYPES}
    from test_gguf import write_tiny

    source = load_model(str(tiny_checkpoint), dtype="float32", device="cpu", progress=False)
    gguf = write_tiny(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "ud-q4_k_xl", model=source)
    models[GGUF] = load_model(str(gguf), dtype="bfloat16", device="cuda", progress=False)
    return models


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _specs() -> list[dict]:
    """Prompts on both sides of the tiny model's QSA dense limit (35 tokens), greedy and seeded."""
    return [dict(prompt_ids=_prompt(n, seed=n), max_tokens=24, sampling=SEEDED if n % 2 else SamplingParams())
            for n in (5, 30, 77, 180)]


def _run(engine: Engine, specs: list[dict], starts: list[int]) -> list[list[int]]:
    requests = run_staggered(engine, specs, starts)
    assert all(r.error is None for r in requests)
    return [r.output_ids for r in requests]


@pytest.mark.parametrize("compiled", [False, True], ids=["graph", "compiled graph"])
@pytest.mark.parametrize("name", NAMES)
def test_graph_decode_alone_equals_together(models, name, compiled):
    engine = Engine(models[name], slots=4, context=CONTEXT, chunk=CHUNK, compile_decode=compiled)
    assert engine.decoder.graph is not None, "the decode step must be a CUDA graph on a GPU"
    specs = _specs()
    alone = [_run(engine, [spec], [0])[0] for spec in specs]
    for starts in ([0, 0, 0, 0], [0, 3, 7, 12], [9, 0, 2, 5]):
        assert _run(engine, specs, starts) == alone, f"starts {starts}"
    if compiled:    # inductor may fuse and round differently from the eager kernels: reported, not required
        eager = _run(Engine(models[name], slots=4, context=CONTEXT, chunk=CHUNK, cuda_graphs=False), specs,
                     [0, 0, 0, 0])
        same = sum(a == b for a, b in zip(alone, eager))
        print(f"{name}: compiled decode gives the eager step's tokens for {same} of {len(specs)} requests")


@pytest.mark.parametrize("beside, batch", [(True, False), (False, False), (True, True)],
                         ids=["decode-between-layers", "decode-after-chunks", "prompts-batched"])
@pytest.mark.parametrize("name", NAMES)
def test_alone_equals_together_on_every_logits_row(models, name, beside, batch, monkeypatch):
    """Not only the tokens: every logits row a request's tokens come from is, bit for bit, the row it gets
    alone, whatever its neighbours do (prefill beside decode included, with their steps also queued between a
    prompt chunk's layers, as `decode_beside_prompts` has them, or not; with `batch_prompts`, prompt chunks of
    several slots in one forward, sharing the routed experts' launch: three short prompts in one chunk below)."""
    record_logits(monkeypatch)
    engine = Engine(models[name], slots=4, context=CONTEXT, chunk=CHUNK, decode_beside_prompts=beside,
                    batch_prompts=batch)
    short = [dict(prompt_ids=_prompt(n, seed=60 + n), max_tokens=12, sampling=SEEDED if n % 2 else SamplingParams())
             for n in (3, 5, 7, 11)]
    runs = [(_specs(), [0, 3, 7, 12]), (_specs(), [9, 0, 2, 5])] + ([(short, [0, 0, 0, 0])] if batch else [])
    for specs, starts in runs:
        alone = [run_staggered(engine, [spec], [0])[0] for spec in specs]
        for got, want in zip(run_staggered(engine, specs, starts), alone):
            assert_same_logits(got, want, f"{name}, starts {starts}, {len(want.prompt_ids)}-token prompt")


@pytest.mark.parametrize("name", NAMES)
def test_warm_equals_cold_on_every_logits_row(models, name, monkeypatch):
    record_logits(monkeypatch)
    model = models[name]
    cache = PrefixCache(CHUNK, 1 << 30, SnapshotBackend.for_device(torch.device("cuda")),
                        model.config.indexer_compress_ratio)
    specs = [dict(prompt_ids=_prompt(n, seed=40 + n), max_tokens=16, sampling=sampling)
             for n in (150, 160) for sampling in (SamplingParams(), SEEDED)]
    cold = run_staggered(Engine(model, slots=4, context=CONTEXT, chunk=CHUNK), specs, [0, 0, 0, 0])
    engine = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK, prefix_cache=cache)
    run_staggered(engine, specs, [0, 0, 0, 0])
    warm = run_staggered(engine, specs[::-1], [0, 0, 0, 0])[::-1]
    assert all(r.cached_tokens for r in warm)
    for got, want in zip(warm, cold):
        assert_same_logits(got, want, f"{name}, {len(want.prompt_ids)}-token prompt, warm against cold")


@pytest.mark.parametrize("name", NAMES)
def test_graph_replay_equals_eager_decode(models, name):
    specs = _specs()
    graphed = _run(Engine(models[name], slots=4, context=CONTEXT, chunk=CHUNK), specs, [0, 1, 2, 3])
    eager = _run(Engine(models[name], slots=4, context=CONTEXT, chunk=CHUNK, cuda_graphs=False), specs, [0, 1, 2, 3])
    assert graphed == eager


@pytest.mark.parametrize("compiled", [False, True], ids=["graph", "compiled graph"])
@pytest.mark.parametrize("name", NAMES)
def test_warm_equals_cold_from_pinned_host_snapshots(models, name, compiled):
    model = models[name]
    cache = PrefixCache(CHUNK, 1 << 30, SnapshotBackend.for_device(torch.device("cuda")),
                        model.config.indexer_compress_ratio)
    assert cache.backend.tier == "host" and cache.backend.pinned
    engine = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK, prefix_cache=cache, compile_decode=compiled)
    specs = [dict(prompt_ids=_prompt(n, seed=40 + n), max_tokens=16, sampling=sampling)
             for n in (150, 160) for sampling in (SamplingParams(), SEEDED)]
    cold = _run(Engine(model, slots=4, context=CONTEXT, chunk=CHUNK, compile_decode=compiled), specs, [0, 0, 0, 0])
    first = _run(engine, specs, [0, 0, 0, 0])
    warm = _run(engine, specs[::-1], [0, 0, 0, 0])[::-1]      # other slots than at capture
    assert warm == first == cold
    assert cache.counters.restored_tokens == 144 * 2 + 160 * 2


def test_an_engine_made_while_snapshots_copy_captures_its_graph(models, monkeypatch):
    """Snapshots are filled by a background thread (pinned allocations, copies on their own stream). An engine made
    meanwhile (here one with no cache) captures its decode step as a CUDA graph; a driver call from the copier
    during that capture would invalidate it and leave the process unable to capture at all. The capture waits for
    the copies queued so far (held back here for 3 s, past the moment it would begin), and the engine serves as
    usual."""
    model = models["bfloat16"]
    cache = PrefixCache(CHUNK, 1 << 30, SnapshotBackend.for_device(torch.device("cuda")),
                        model.config.indexer_compress_ratio)
    engine = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK, prefix_cache=cache)
    specs = [dict(prompt_ids=_prompt(n, seed=70 + n), max_tokens=8) for n in (150, 160)]
    held = threading.Event()
    cache._copier._thread.submit(held.wait)
    try:
        first = _run(engine, specs, [0, 0])                 # its snapshots' copies wait behind `held`
        threading.Timer(3.0, held.set).start()          # later than the engine reaches its capture
        released_at_capture = []
        real_begin = torch.cuda.CUDAGraph.capture_begin

        def capture_begin(graph, *args, **kwargs):
            released_at_capture.append(held.is_set())
            return real_begin(graph, *args, **kwargs)
        monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin)
        other = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK)
        assert other.decoder.graph is not None and released_at_capture == [True]
        assert _run(other, specs, [0, 0]) == first
    finally:
        held.set()
        engine.stop()


def test_float32_engine_follows_reference_greedy_ids(models, tiny_checkpoint):
    transformers = pytest.importorskip("transformers")
    from test_gpu_parity import exact_reference

    reference = transformers.Qwen4ExpForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32, device_map="cuda").eval()
    prompts = [_prompt(120, seed=1), _prompt(40, seed=2)]
    engine = Engine(models["float32"], slots=4, context=CONTEXT, chunk=CHUNK)
    ours = _run(engine, [dict(prompt_ids=p, max_tokens=48) for p in prompts], [0, 0])
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad(), exact_reference():
            out = reference.generate(ids, max_new_tokens=48, min_new_tokens=48, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()


def test_a_quantized_ple_table_in_host_memory_gives_what_it_gives_on_the_device(tmp_path):
    """The GPU reads the table's rows from pinned host memory in place (decode steps in CUDA graphs included):
    every request's tokens are those of the table on the device, and the device holds the table's bytes less."""
    from qwen4exp.engine.fit_measure import weight_bytes
    from test_engine_config import quantized_table_model

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    path, _ = quantized_table_model(tmp_path)
    gpu = torch.device("cuda", 0)
    on_device = load_model(str(path), dtype="bfloat16", device=gpu, progress=False)
    on_host = load_model(str(path), dtype="bfloat16", device=gpu, progress=False, ple_on_host=True)
    table = on_host.model.layers[1].ple.ple_embedding.ngram_embedding
    assert table.host and table.blocks.is_pinned()
    assert weight_bytes(on_host, gpu) == weight_bytes(on_device, gpu) - table.blocks.numel()
    specs = _specs()
    starts = [0, 3, 7, 12]
    assert (_run(Engine(on_host, slots=4, context=CONTEXT, chunk=CHUNK), specs, starts)
            == _run(Engine(on_device, slots=4, context=CONTEXT, chunk=CHUNK), specs, starts))


@pytest.mark.parametrize("name", NAMES)
def test_a_model_parked_in_host_memory_comes_back_the_same(models, name, monkeypatch):
    """Park level "offload": every weight leaves the device for pinned host memory (the device keeps none of
    them), and the model brought back gives every logits row it gave before, bit for bit."""
    from qwen4exp.engine.offload import offload, restore

    record_logits(monkeypatch)
    model, specs = models[name], _specs()
    before = run_staggered(Engine(model, slots=4, context=CONTEXT, chunk=CHUNK), specs, [0, 1, 2, 3])
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    moved = offload(model)
    tensors = [*model.parameters(), *model.buffers()]
    assert moved > 0 and all(t.device.type == "cpu" and t.is_pinned() for t in tensors)
    assert held - torch.cuda.memory_allocated() >= moved
    restore(model, torch.device("cuda"))
    after = run_staggered(Engine(model, slots=4, context=CONTEXT, chunk=CHUNK), specs, [0, 1, 2, 3])
    for got, want in zip(after, before):
        assert_same_logits(got, want, f"{name}, {len(want.prompt_ids)}-token prompt, after an offload park")


@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "together"])
@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("slots", [1, 4])
def test_mtp_on_equals_off_on_the_gpu(models, name, slots, together, monkeypatch):
    """Speculative decoding (3 drafts a step, an oracle's drafts partly wrong) beside plain decoding from the
    CUDA graph: every logits row each request's tokens come from is the same, greedy and seeded; with the verify
    step's positions one plain step after another, and together (each product's rows as plain steps compute them:
    the bfloat16 model's cuBLAS projections a sub-step at a time)."""
    from test_speculative import _oracle

    from qwen4exp.engine.model.triton_ops import TritonOps

    monkeypatch.setattr(TritonOps, "rows_independent", together)
    record_logits(monkeypatch)
    model, specs, starts = models[name], _specs(), [0, 2, 5, 9]
    plain = run_staggered(Engine(model, slots=slots, context=CONTEXT, chunk=CHUNK), specs, starts)
    _oracle(monkeypatch, {tuple(s["prompt_ids"]): r.output_ids for s, r in zip(specs, plain)}, random.Random(3),
            wrong=0.3)
    engine = Engine(model, slots=slots, context=CONTEXT, chunk=CHUNK, mtp=3, mtp_adaptive=False)
    drafted = run_staggered(engine, specs, starts)
    assert 0 < engine.drafter.counters.accepted < engine.drafter.counters.drafted
    for got, want in zip(drafted, plain):
        assert_same_logits(got, want, f"{name}, {slots} slots, {len(want.prompt_ids)}-token prompt, with drafts")


def test_mtp_drafting_by_measured_step_costs_on_the_gpu(models, monkeypatch):
    """An adaptive engine measures its graphed steps at start (every slot empty, and left so) and drafts what
    that table says pays: plain decoding's logits rows all the same."""
    from test_speculative import _oracle

    from qwen4exp.engine.model.triton_ops import TritonOps

    monkeypatch.setattr(TritonOps, "rows_independent", True)
    record_logits(monkeypatch)
    model, specs, starts = models["bfloat16"], _specs(), [0, 2, 5, 9]
    plain = run_staggered(Engine(model, slots=4, context=CONTEXT, chunk=CHUNK), specs, starts)
    _oracle(monkeypatch, {tuple(s["prompt_ids"]): r.output_ids for s, r in zip(specs, plain)}, random.Random(3),
            wrong=0.3)
    engine = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK, mtp=3)
    costs = engine.step_costs
    assert costs is not None and costs.busy == [1, 2, 4] and sorted(costs.seconds) == [1, 2, 3, 4]
    assert all(t > 0 for times in costs.seconds.values() for t in times)
    assert all(not t.any() for t in engine.pool.states.carried() if t.dtype != torch.long)
    drafted = run_staggered(engine, specs, starts)
    for got, want in zip(drafted, plain):
        assert_same_logits(got, want, f"{len(want.prompt_ids)}-token prompt, drafts chosen by cost")


# ---- split serving (engine/placement.py): layers on another device, handed across at each boundary -----------------
def _split(tiny_checkpoint, dtype: str, target: str, device: str, layers: int):
    from qwen4exp.engine.placement import Placement

    model = load_model(str(tiny_checkpoint), dtype=dtype, device=target, progress=False)
    model.place(Placement.with_split(target, len(model.model.layers), [(device, layers)]))
    return model


def _warm_and_cold(model, what: str) -> None:
    """Staggered requests against each alone (engines without a prefix cache), then the same prompts from the
    prefix cache against those cold rows."""
    specs = _specs()
    alone = [run_staggered(Engine(model, slots=4, context=CONTEXT, chunk=CHUNK), [spec], [0])[0] for spec in specs]
    together = run_staggered(Engine(model, slots=4, context=CONTEXT, chunk=CHUNK), specs, [0, 3, 7, 12])
    for got, want in zip(together, alone):
        assert_same_logits(got, want, f"{what}, {len(want.prompt_ids)}-token prompt")
    cache = PrefixCache(CHUNK, 1 << 30, SnapshotBackend.for_device(model.lm_head.weight.device),
                        model.config.indexer_compress_ratio)
    engine = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK, prefix_cache=cache)
    run_staggered(engine, specs, [0, 0, 0, 0])
    warm = run_staggered(engine, specs[::-1], [0, 0, 0, 0])[::-1]
    assert all(r.cached_tokens for r in warm if len(r.prompt_ids) > CHUNK)   # a shorter one has no snapshot
    for got, want in zip(warm, alone):
        assert_same_logits(got, want, f"{what}, warm against cold")


@pytest.mark.parametrize("layers", [3, 7], ids=["last-three", "with-the-ple-layer"])
@pytest.mark.parametrize("name", DTYPES)
def test_layers_on_the_host_keep_alone_equal_to_together_and_warm_equal_to_cold(models, tiny_checkpoint, name,
                                                                                layers, monkeypatch):
    """The last layers (a QSA layer's cache with them; with 7, the PLE layer too) on the CPU beside the GPU, the
    CPU's torch forms running them: every logits row is the one a request gets alone, warm or cold (snapshots
    hold the host layers' state too); the decode step runs in segments, the GPU's two from CUDA graphs
    (segmented_decode.py), and gives the eager step's logits."""
    record_logits(monkeypatch)
    model = _split(tiny_checkpoint, name, "cuda:0", "cpu", layers)
    assert model.spans_devices and model.model.layers[7].mlp.gate.weight.device.type == "cpu"
    engine = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK, decode_beside_prompts=True)
    assert engine.decoder.graph is None and not engine.decode_beside_prompts
    assert engine.decoder.segmented.graphs == 2 and len(engine.decoder.segmented.segments) == 3
    specs = _specs()
    eager = run_staggered(Engine(model, slots=4, context=CONTEXT, chunk=CHUNK, cuda_graphs=False), specs, [0, 2, 5, 9])
    for got, want in zip(run_staggered(engine, specs, [0, 2, 5, 9]), eager):
        assert_same_logits(got, want, f"{name}, {layers} layers on the host: graphed segments against eager")
    _warm_and_cold(model, f"{name}, {layers} layers on the host beside the GPU")


def test_a_split_model_parked_in_host_memory_comes_back_where_it_was(tiny_checkpoint):
    from qwen4exp.engine.offload import offload, restore

    model = _split(tiny_checkpoint, "bfloat16", "cuda:0", "cpu", 3)
    ids = torch.arange(1, 60, device="cuda")
    before = model(ids, model.new_state(128), all_logits=True)
    offload(model)
    assert all(t.device.type == "cpu" for t in model.parameters())
    restore(model, torch.device("cuda:0"))
    devices = [layer.mlp.gate.weight.device.type for layer in model.model.layers]
    assert devices == ["cuda"] * 5 + ["cpu"] * 3 and model.lm_head.weight.device.type == "cuda"
    assert torch.equal(model(ids, model.new_state(128), all_logits=True), before)


@pytest.mark.parametrize("target, split", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")])
@pytest.mark.parametrize("name", DTYPES)
def test_layers_on_a_second_gpu_give_the_one_gpu_numbers(models, tiny_checkpoint, name, target, split, monkeypatch):
    """Two GPUs of one kind run the same kernels: a split model's every logits row is the unsplit model's, warm or
    cold, with drafts or without (also with the target on the second GPU)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: the split over two is measured on nvidia-h200-x2")
    from test_speculative import _oracle

    record_logits(monkeypatch)
    model = _split(tiny_checkpoint, name, target, split, 5)
    specs, starts = _specs(), [0, 3, 7, 12]
    # The unsplit engine eager, the split one replaying its segments' graphs: the same kernels on the same inputs.
    want = run_staggered(Engine(models[name], slots=4, context=CONTEXT, chunk=CHUNK, cuda_graphs=False), specs,
                         starts)
    engine = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK)
    assert engine.decoder.segmented.graphs == 3          # the target's two segments and the second GPU's
    got = run_staggered(engine, specs, starts)
    for a, b in zip(got, want):
        assert_same_logits(a, b, f"{name} split over {target} and {split}, {len(b.prompt_ids)}-token prompt")
    _oracle(monkeypatch, {tuple(s["prompt_ids"]): r.output_ids for s, r in zip(specs, want)}, random.Random(3),
            wrong=0.3)
    engine = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK, mtp=3, mtp_adaptive=False)
    drafted = run_staggered(engine, specs, starts)
    assert 0 < engine.drafter.counters.accepted < engine.drafter.counters.drafted
    for a, b in zip(drafted, want):
        assert_same_logits(a, b, f"{name} split over {target} and {split}, with drafts")
    _warm_and_cold(model, f"{name} split over {target} and {split}")
    # Hot experts (engine/hot_experts.py): the hot pairs run on the target's copies, with the same kernels.
    from qwen4exp.engine import hot_experts
    hot_experts.keep_hot(model, {i: (1, 4, 6) for i in hot_experts.split_experts(model)})
    engine = Engine(model, slots=4, context=CONTEXT, chunk=CHUNK)
    assert engine.decoder.segmented.graphs == 2          # the split device's run crosses devices: eager
    hot = run_staggered(engine, specs, starts)
    for a, b in zip(hot, want):
        assert_same_logits(a, b, f"{name} split over {target} and {split}, hot experts on {target}")

"""The `qwen4exp generate` command as a user runs it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qwen4exp.cli import main
from qwen4exp.engine.engine import Engine
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.request import Request
from qwen4exp.tokenizer import Tokenizer


@pytest.fixture(autouse=True)
def default_profile(monkeypatch):
    """`generate` reads the profile `serve` would: here always the shipped tiny one, whatever the environment says."""
    monkeypatch.delenv("QWEN4EXP_PROFILE", raising=False)
    monkeypatch.delenv("QWEN4EXP_PROFILE_PATH", raising=False)


def _run(capsys, *argv) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_generate_json_prints_ids_text_and_timings(tiny_checkpoint, capsys):
    out = json.loads(_run(capsys, "generate", "--model", str(tiny_checkpoint), "--prompt", "Hello there",
                          "--max-tokens", "8", "--greedy", "--ignore-eos", "--json"))
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"
    tokenizer = Tokenizer.from_dir(tiny_checkpoint)
    assert out["text"] == tokenizer.decode(out["token_ids"])
    assert out["prompt_tokens"] == len(tokenizer.encode("Hello there"))
    assert out["timings"]["prefill_ms"] > 0 and out["timings"]["decode_tokens_per_s"] > 0


def test_generate_with_mtp_gives_the_same_answer_and_reports_its_drafts(capsys):
    """The embedded model's own MTP head drafting 2 tokens a step: the same ids as without, and how many of its
    drafts were taken."""
    args = ("generate", "--prompt", "In the beginning God created", "--max-tokens", "24", "--ignore-eos", "--json")
    plain = json.loads(_run(capsys, *args))
    drafting = json.loads(_run(capsys, *args, "--mtp", "2"))
    assert drafting["token_ids"] == plain["token_ids"] and plain["mtp"] == {"drafted": 0, "accepted": 0}
    assert 0 < drafting["mtp"]["accepted"] <= drafting["mtp"]["drafted"]
    with pytest.raises(SystemExit, match="mtp = '9'.*from 0 to 7"):
        main([*args, "--mtp", "9"])


def test_prompts_file_runs_together_and_prints_in_order(tiny_checkpoint, tmp_path, capsys):
    lines = [{"prompt": "The mill by the river", "max_tokens": 6},
             {"prompt_ids": list(range(5, 205)), "max_tokens": 9, "temperature": 0.8, "seed": 3},
             {"prompt": "Hi<|im_end|>", "chat": True, "max_tokens": 4, "stop_token_ids": []}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = json.loads(_run(capsys, "generate", "--model", str(tiny_checkpoint), "--prompts-file", str(path),
                          "--json", "--slots", "2", "--chunk", "64", "--ignore-eos"))
    answers = out["answers"]
    assert [a["index"] for a in answers] == [0, 1, 2]
    assert [len(a["token_ids"]) for a in answers] == [6, 9, 4]
    assert answers[1]["prompt_tokens"] == 200
    # A chat line is tokenized as the server tokenizes a chat: the special string in its text stays text.
    tokenizer = Tokenizer.from_dir(tiny_checkpoint)
    assert answers[2]["prompt_tokens"] == len(tokenizer.encode_chat([{"role": "user", "content": "Hi<|im_end|>"}]))
    # Each answer is what the engine gives that request alone (same slots and chunk).
    model = load_model(str(tiny_checkpoint), dtype="float32", device="cpu", progress=False)
    from qwen4exp.engine.sampling import SamplingParams
    engine = Engine(model, slots=2, context=out["context"], chunk=64)
    alone = engine.submit(Request(prompt_ids=list(range(5, 205)), max_tokens=9,
                                  sampling=SamplingParams(temperature=0.8, seed=3)))
    engine.run_until_idle()
    assert answers[1]["token_ids"] == alone.output_ids


@pytest.fixture(scope="module")
def tiny_server():
    """A live server for the shipped tiny profile (4 slots, chunk 64, the embedded model), as `serve` builds it."""
    from live_server import Server

    from qwen4exp.config import load_settings
    from qwen4exp.engine.engine_config import EngineConfig

    s = Server(None, config=EngineConfig.from_settings(load_settings("tiny", env={})))
    yield s
    s.close()


PROMPT = ("And it came to pass, when the king had heard the words of the book of the law, that he rent his clothes. "
          "And the king commanded Hilkiah the priest, and Ahikam the son of Shaphan, saying, Go ye, enquire of the "
          "LORD for me, and for the people, and for all Judah, concerning the words of this book that is found: for "
          "great is the wrath of the LORD that is kindled against us, because our fathers have not hearkened unto the "
          "words of this book, to do according unto all that which is written concerning us. So Hilkiah the priest, "
          "and Ahikam, and Achbor, and Shaphan, and Asahiah, went unto Huldah the prophetess, the wife of Shallum")


SEEDED = ({"temperature": 0.8, "seed": 7}, ["--temperature", "0.8", "--seed", "7"])


@pytest.mark.parametrize("sampling, flags", [({}, ["--greedy"]), SEEDED])
def test_generate_prompt_gives_the_served_answer(tiny_server, capsys, sampling, flags):
    """`generate --prompt` with the profile's settings answers what the daemon serving that profile answers, id for
    id and character for character: the prompt is cut on the profile's chunk grid (it spans three chunks of 64)
    and decoded by the engine's own step, greedy or sampled with a seed."""
    from qwen4exp.model_dir import resolve_model
    from qwen4exp.tokenizer import Tokenizer

    assert len(Tokenizer.from_dir(resolve_model("tiny")).encode(PROMPT)) > 128
    body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, **sampling}
    status, served, _ = tiny_server.request("POST", "/generate", body)
    assert status == 200, served
    out = json.loads(_run(capsys, "generate", "--prompt", PROMPT, "--max-tokens", "40", "--ignore-eos", "--json",
                          *flags))
    assert out["token_ids"] == served["token_ids"] and out["text"] == served["text"]
    assert out["finish_reason"] == served["finish_reason"] == "length"
    status, completion, _ = tiny_server.request("POST", "/v1/completions", body)
    assert completion["choices"][0]["text"] == out["text"]


def test_generate_chat_gives_the_served_chat_answer(tiny_server, capsys):
    question = "Who made the heaven and the earth?"
    status, served, _ = tiny_server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": question}], "max_tokens": 30})
    assert status == 200, served
    out = json.loads(_run(capsys, "generate", "--chat", "--prompt", question, "--max-tokens", "30", "--json"))
    choice = served["choices"][0]
    assert out["text"] == choice["message"]["content"] and out["finish_reason"] == choice["finish_reason"]


@pytest.mark.parametrize("argv, message", [
    (["--chunk", "3"], "chunk"),
    (["--slots", "17"], "slots"),
    (["--set", "prefix_cache.spacing=48"], "prefix_cache.spacing"),
])
def test_generate_refuses_bad_settings_by_name(argv, message):
    with pytest.raises(SystemExit) as err:
        main(["generate", "--prompt", "Hello", *argv])
    assert "error:" in str(err.value) and message in str(err.value)


def test_generate_on_a_broken_gguf_or_a_directory_without_tokenizer_is_one_error_line(tmp_path, tiny_checkpoint):
    """The tokenizer is the first thing read from a GGUF: what is wrong with the file is said there."""
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((Path(__file__).parent / "data" / "tiny_llamacpp_f32.gguf").read_bytes()[:-1000])
    bare = tmp_path / "bare"
    shutil.copytree(tiny_checkpoint, bare)
    (bare / "tokenizer.json").unlink()
    for model, message in [(cut, "cut.gguf: not a readable GGUF file"), (bare, "no tokenizer.json in")]:
        with pytest.raises(SystemExit) as err:
            main(["generate", "--model", str(model), "--prompt", "Hello", "--max-tokens", "2"])
        assert str(err.value).startswith("error:") and message in str(err.value), err.value


@pytest.mark.parametrize("line, message", [
    ("{not json", "prompts.jsonl:2: not valid JSON"),
    ('{"prompt": "a", "prompt_ids": [1]}', "prompts.jsonl:2: give exactly one of"),
    ('{"prompt": "a", "temprature": 0.5}', "temprature"),
    ('{"prompt_ids": [1, "x"]}', 'prompts.jsonl:2: "prompt_ids" must be a list of integers'),
    ('{"prompt": "a", "stop_token_ids": [true]}', 'prompts.jsonl:2: "stop_token_ids" must be a list of token ids'),
    ('{"prompt": "a", "stop_token_ids": [-5]}', 'prompts.jsonl:2: "stop_token_ids" must be a list of token ids'),
    ('{"prompt": "a", "chat": "yes"}', 'prompts.jsonl:2: "chat" must be true or false'),
])
def test_prompts_file_errors_name_the_line(tiny_checkpoint, tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(SystemExit) as err:
        main(["generate", "--model", str(tiny_checkpoint), "--prompts-file", str(path)])
    assert message in str(err.value)


def test_a_too_long_request_is_refused_with_the_numbers(tiny_checkpoint, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1] * 100, "max_tokens": 50}) + "\n")
    with pytest.raises(SystemExit) as err:
        main(["generate", "--model", str(tiny_checkpoint), "--prompts-file", str(path), "--context", "128"])
    assert "request 1: prompt of 100 tokens + max_tokens 50 = 150 exceeds the context of 128 tokens" in str(err.value)


def test_set_changes_any_key_and_names_the_command_line(capsys, monkeypatch):
    monkeypatch.delenv("QWEN4EXP_PROFILE", raising=False)
    assert main(["profiles", "show", "--set", "server.port=9123", "--set", "prefix_cache.resident_limit=2GiB"]) == 0
    shown = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert shown["server.port"] == ["9123", "command", "line"]
    assert shown["prefix_cache.resident_limit"] == [str(2 << 30), "command", "line"]
    with pytest.raises(SystemExit, match="unknown key server.prot"):
        main(["serve", "--set", "server.prot=1"])
    with pytest.raises(SystemExit, match="not key=value"):
        main(["serve", "--set", "port"])


def test_generate_refuses_a_request_past_the_models_trained_context(tmp_path):
    with pytest.raises(SystemExit, match=r"error: a prompt of \d+ tokens \+ max tokens 1000000 is past the model's "
                                         r"trained context of 4096 positions"):
        main(["generate", "--prompt", "Hello", "--max-tokens", "1000000"])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a", "max_tokens": 4}\n{"prompt": "b", "max_tokens": 100000}\n')
    with pytest.raises(SystemExit, match=r"prompts.jsonl request 2: a prompt of \d+ tokens \+ max tokens 100000"):
        main(["generate", "--prompts-file", str(prompts)])


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "--layers 0: a model has at least 1 layer"),
    (["--device", "tpu"], "device 'tpu' is not one this engine runs on"),
    (["--quant", "q8_0"], "--quant 'q8_0' chooses a GGUF's mix; add --format gguf"),
    (["--format", "gguf", "--quant", "q3_bogus"], "--quant 'q3_bogus': choose one of f32, bf16"),
])
def test_init_checkpoint_refuses_before_drawing_weights(tmp_path, argv, message):
    with pytest.raises(SystemExit) as err:
        main(["init-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "new"), *argv])
    assert str(err.value).startswith("error: ") and message in str(err.value)
    assert not (tmp_path / "new").exists()


def test_init_checkpoint_overwrites_nothing(tmp_path):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "config.json").write_text("{}")
    for out, form in [(kept, "safetensors"), (kept / "config.json", "gguf")]:
        with pytest.raises(SystemExit, match="is there already; choose a new path"):
            main(["init-checkpoint", "--preset", "tiny", "--format", form, "--out", str(out)])
    assert (kept / "config.json").read_text() == "{}" and len(list(kept.iterdir())) == 1


def test_serve_refuses_what_would_stop_it_before_loading_the_model(tmp_path):
    """A port another process listens on, and files the load cannot read, are said before the model loads."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"error: cannot listen on 127.0.0.1:{port} \\(server.host, "
                                             f"server.port\\): Address already in use"):
            main(["serve", "--port", str(port)])
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(SystemExit, match="empty.gguf' is not a usable GGUF: .*not a readable GGUF file"):
        main(["serve", "--model", str(empty)])

"""Models named by Hugging Face id (`org/repo`, `org/repo:QUANT`, `@revision`), resolved through huggingface_hub's
cache with no network: each test builds a cache in tmp_path in the layout huggingface_hub reads
(`models--org--repo/refs/<revision>` holding a commit, `models--org--repo/snapshots/<commit>/<files>`, the files
symlinks as huggingface_hub makes them; it needs no `blobs/` to find a snapshot).

huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once, at import; a test in this process sets its `constants` as
a process started with those variables would have them (and the variables too, for any child process). The end-to-end
test runs the real command in a child process with only the environment variables set."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

from qwen4exp.config import ConfigError, check_profile, load_settings
from qwen4exp.hub import HubId, locate
from qwen4exp.model_dir import EMBEDDED_MODEL, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
DAEMON = Path(__file__).resolve().parents[1] / "daemon"
DATA = Path(__file__).resolve().parent / "data"

CHECKPOINT = {"config.json": "{}", "model.safetensors": "weights", "model.safetensors.index.json": "{}",
              "tokenizer.json": "{}", "tokenizer_config.json": "{}", "chat_template.jinja": "{{ x }}",
              "generation_config.json": "{}", "README.md": "text", "original/consolidated.pth": "other format"}
QUANTS = {"Model-Q8_0.gguf": "q8", "Model-Q4_K_M.gguf": "q4", "Model-UD-Q8_0.gguf": "ud-q8",
          **{f"UD-Q4_K_XL/Model-UD-Q4_K_XL-0000{n}-of-00003.gguf": f"shard {n}" for n in (1, 2, 3)},
          "mmproj-F16.gguf": "vision projector", "README.md": "text"}


def cache_repo(cache: Path, repo: str, files: dict[str, str | Path], commit: str = COMMIT,
               ref: str = "main") -> Path:
    """One commit of `repo` in a huggingface_hub cache; returns its snapshot directory. A Path value is linked as a
    cached file is (snapshot entry -> blob), a str is written there."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / ref).write_text(commit)
    snapshot = storage / "snapshots" / commit
    for name, content in files.items():
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            target.symlink_to(content)
        else:
            blob = storage / "blobs" / f"{abs(hash((name, content))):x}"
            blob.parent.mkdir(exist_ok=True)
            blob.write_text(content)
            target.symlink_to(os.path.relpath(blob, target.parent))
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache, offline: the state of a process started with HF_HUB_CACHE=<it> and HF_HUB_OFFLINE=1."""
    directory = tmp_path / "hf-cache"
    directory.mkdir()
    for name, value in (("HF_HUB_CACHE", str(directory)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
        monkeypatch.setattr(constants, name, value if name == "HF_HUB_CACHE" else True)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("QWEN4EXP_PROFILE", raising=False)
    monkeypatch.delenv("QWEN4EXP_PROFILE_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    return directory


def error_of(name: str) -> str:
    with pytest.raises(SystemExit) as caught:
        resolve_model(name)
    return str(caught.value)


# --- what is an id ---

def test_ids_parse_and_paths_do_not():
    assert HubId.parse("Qwen/Qwen3.8-Flash-Next") == HubId("Qwen/Qwen3.8-Flash-Next")
    assert HubId.parse("unsloth/Qwen3.8-Flash-Next-GGUF:UD-Q4_K_XL@main") == \
        HubId("unsloth/Qwen3.8-Flash-Next-GGUF", "UD-Q4_K_XL", "main")
    assert str(HubId.parse("org/repo:Q8_0@refs/pr/1")) == "org/repo:Q8_0@refs/pr/1"
    for path in ("tiny", "/srv/models/x", "./org/repo", "org/repo/sub", "org/model.gguf", "~/models/x", "a--b/c",
                 "org/"):
        assert HubId.parse(path) is None, path


# --- resolving from the cache, offline ---

def test_org_repo_resolves_to_the_snapshot_with_the_checkpoint_files(cache):
    snapshot = cache_repo(cache, "org/repo", CHECKPOINT)
    assert resolve_model("org/repo") == snapshot
    assert set(locate(HubId("org/repo")).files) == {name for name in CHECKPOINT
                                                   if name.endswith((".json", ".safetensors", ".jinja"))}


def test_a_quant_picks_its_gguf_among_several(cache):
    snapshot = cache_repo(cache, "org/gguf", QUANTS)
    assert resolve_model("org/gguf:Q8_0") == snapshot / "Model-Q8_0.gguf"        # not UD-Q8_0: not its whole name
    assert resolve_model("org/gguf:q4_k_m") == snapshot / "Model-Q4_K_M.gguf"     # any case, as llama.cpp's -hf
    assert resolve_model("org/gguf:UD-Q8_0") == snapshot / "Model-UD-Q8_0.gguf"
    assert locate(HubId("org/gguf", "Q8_0")).files == ("Model-Q8_0.gguf",)      # that file and nothing else


def test_a_split_set_resolves_to_its_first_file(cache):
    snapshot = cache_repo(cache, "org/gguf", QUANTS)
    first = snapshot / "UD-Q4_K_XL" / "Model-UD-Q4_K_XL-00001-of-00003.gguf"
    assert resolve_model("org/gguf:UD-Q4_K_XL") == first
    assert resolve_model("org/gguf:Q4_K_XL") == first
    assert len(locate(HubId("org/gguf", "UD-Q4_K_XL")).files) == 3


def test_an_unknown_quant_lists_the_quants_the_repo_has(cache):
    cache_repo(cache, "org/gguf", QUANTS)
    message = error_of("org/gguf:Q5_K_M")
    assert "org/gguf has no GGUF files of quant 'Q5_K_M'" in message
    assert "Q4_K_M, Q8_0, UD-Q8_0, UD-Q4_K_XL" in message and "mmproj" not in message


def test_an_ambiguous_quant_is_refused_listing_the_candidates(cache):
    cache_repo(cache, "org/gguf", QUANTS)
    message = error_of("org/gguf:Q4")
    assert "matches more than one GGUF model" in message
    assert "Model-Q4_K_M.gguf" in message and "UD-Q4_K_XL/Model-UD-Q4_K_XL-00001-of-00003.gguf (3 files)" in message


def test_a_split_set_missing_a_shard_is_refused(cache):
    cache_repo(cache, "org/part", {"Q8_0/M-Q8_0-00001-of-00002.gguf": "1"})
    assert "split set Q8_0/M-Q8_0 is incomplete: only shards 1 of 2" in error_of("org/part:Q8_0")


def test_a_gguf_only_repo_needs_its_quant_unless_it_has_one(cache, caplog):
    snapshot = cache_repo(cache, "org/one", {"Model-Q8_0.gguf": "q8", "README.md": "text"})
    with caplog.at_level(logging.INFO, logger="qwen4exp.hub"):
        assert resolve_model("org/one") == snapshot / "Model-Q8_0.gguf"
    assert "GGUF files of one quant, Q8_0: using Model-Q8_0.gguf" in caplog.text
    cache_repo(cache, "org/gguf", QUANTS)
    assert "holds GGUF files of several quants; name one, e.g. org/gguf:Q4_K_M" in error_of("org/gguf")
    cache_repo(cache, "org/checkpoint", CHECKPOINT)
    assert "org/checkpoint has no GGUF files; if it is a safetensors checkpoint, name it without ':Q8_0'" \
        in error_of("org/checkpoint:Q8_0")


def test_an_id_not_in_the_cache_names_the_id_and_the_cache(cache):
    message = error_of("org/absent")
    assert f"model 'org/absent': org/absent is not in the Hugging Face cache at {cache}" in message
    assert message.endswith(f"and HF_HUB_OFFLINE is set (unset it to download); nor is there a file or directory "
                            f"org/absent in {Path.cwd()}")
    cache_repo(cache, "org/gguf", QUANTS)
    assert f"org/gguf at revision 'v2' is not in the Hugging Face cache at {cache}" in error_of("org/gguf:Q8_0@v2")


def test_a_revision_reads_its_own_snapshot(cache):
    cache_repo(cache, "org/repo", CHECKPOINT)
    older = cache_repo(cache, "org/repo", {"config.json": "{}", "model.safetensors": "old"}, OTHER_COMMIT, ref="v1")
    assert resolve_model("org/repo@v1") == older
    assert resolve_model(f"org/repo@{OTHER_COMMIT}") == older


def test_a_local_directory_named_like_an_id_wins(cache, tmp_path):
    cache_repo(cache, "a/b", CHECKPOINT)
    (tmp_path / "a" / "b").mkdir(parents=True)                 # the working directory is tmp_path
    assert resolve_model("a/b") == Path("a/b")
    # In a profile, a relative name is looked up beside the profile first; only when nothing is there is it an id.
    profile = tmp_path / "p.toml"
    profile.write_text('model = "a/b"\n')
    assert load_settings(profile).model == str(tmp_path / "a" / "b")
    (tmp_path / "elsewhere").mkdir()
    other = tmp_path / "elsewhere" / "p.toml"
    other.write_text('model = "a/b"\n')
    assert load_settings(other).model == "a/b"
    assert "is neither a checkpoint directory, a .gguf file, a Hugging Face id" in error_of("no-such-dir")


# --- the Hub (faked: no network), for what only it can say ---

def _fake_hub(monkeypatch, files: dict[str, int], cache: Path):
    """HfApi.model_info listing `files`, and snapshot_download writing what it is asked for into the cache."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    info = SimpleNamespace(sha=COMMIT, siblings=[SimpleNamespace(rfilename=n, size=s) for n, s in files.items()])
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, **kw: info)
    asked = {}

    def download(repo_id, **kwargs):
        import fnmatch
        asked.update(kwargs, repo_id=repo_id)
        wanted = [n for n in files if any(fnmatch.fnmatch(n, p) for p in kwargs["allow_patterns"])]
        return str(cache_repo(Path(kwargs["cache_dir"]), repo_id, {n: "x" for n in wanted}))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    return asked


def test_a_download_fetches_only_the_quant_and_says_what_and_how_much(cache, monkeypatch, caplog):
    gib = 2**30
    asked = _fake_hub(monkeypatch, {"README.md": 10, "Model-Q8_0.gguf": 9 * gib,
                                    **{f"BF16/Model-BF16-0000{n}-of-00002.gguf": 8 * gib for n in (1, 2)}}, cache)
    with caplog.at_level(logging.INFO, logger="qwen4exp.hub"):
        path = resolve_model("org/big:bf16")
    assert path == cache / "models--org--big" / "snapshots" / COMMIT / "BF16" / "Model-BF16-00001-of-00002.gguf"
    assert asked["allow_patterns"] == ["BF16/Model-BF16-00001-of-00002.gguf", "BF16/Model-BF16-00002-of-00002.gguf"]
    assert asked["revision"] is None and asked["local_files_only"] is False and asked["cache_dir"] == str(cache)
    assert f"downloading org/big:bf16 into {cache}: 2 files, 16.0 GiB: BF16/Model-BF16-00001-of-00002.gguf, " \
           "BF16/Model-BF16-00002-of-00002.gguf" in caplog.text


def test_an_unreachable_hub_falls_back_to_the_cache(cache, monkeypatch, caplog):
    _fake_hub(monkeypatch, {}, cache)

    def unreachable(self, repo, **kwargs):
        raise ConnectionError("no route to huggingface.co")
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    snapshot = cache_repo(cache, "org/gguf", QUANTS)
    with caplog.at_level(logging.WARNING, logger="qwen4exp.hub"):
        assert resolve_model("org/gguf:Q8_0") == snapshot / "Model-Q8_0.gguf"
    assert f"the Hugging Face Hub could not be asked (ConnectionError: no route to huggingface.co); using what the " \
           f"cache at {cache} holds" in caplog.text
    assert error_of("org/gguf:Q5_K_M").endswith(f"(as the cache at {cache} lists it; the Hub could not be asked "
                                                "(ConnectionError: no route to huggingface.co))")
    assert f"org/other: the Hub could not be asked (ConnectionError: no route to huggingface.co) and the cache at " \
           f"{cache} does not hold it" in error_of("org/other")


def test_hub_refusals_become_messages(cache, monkeypatch):
    _fake_hub(monkeypatch, {}, cache)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)     # no token file of this machine's either
    response = SimpleNamespace(headers={}, request=None)
    for error, expected in ((GatedRepoError("403", response=response), "org/gated is a gated repository and an "
                             "anonymous request (no HF_TOKEN) has no access to it: ask for it at "
                             f"{constants.ENDPOINT}/org/gated, then set HF_TOKEN"),
                            (RepositoryNotFoundError("404", response=response), "there is no model repository "
                             "org/gated on the Hugging Face Hub that an anonymous request (no HF_TOKEN) can read")):
        def refuse(self, repo, error=error, **kwargs):
            raise error
        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", refuse)
        message = error_of("org/gated")
        assert expected in message and str(cache) in message and "Traceback" not in message


# --- the real path: a profile and the generate command ---

def test_check_validates_an_id_from_the_cache(cache, tmp_path):
    """`check` reads the cached checkpoint's config and index, or the cached GGUF's header, as for a local path."""
    cache_repo(cache, "org/tiny", {p.name: p for p in EMBEDDED_MODEL.iterdir()})
    cache_repo(cache, "org/tiny-GGUF", {"tiny-F32.gguf": DATA / "tiny_llamacpp_f32.gguf", "tiny-Q8_0.gguf": "x"})
    profile = tmp_path / "p.toml"
    for model in ("org/tiny", "org/tiny-GGUF:F32"):
        profile.write_text(f'model = "{model}"\n')
        assert check_profile(profile).model == model
    profile.write_text('model = "org/tiny-GGUF:Q8_0"\n')
    with pytest.raises(ConfigError, match="snapshots/.*/tiny-Q8_0.gguf' is not a usable GGUF"):
        check_profile(profile)
    profile.write_text('model = "org/absent"\n')
    with pytest.raises(ConfigError, match=f"model = 'org/absent': org/absent is not in the Hugging Face cache at "
                                          f"{cache}"):
        check_profile(profile)


def test_an_id_generates_what_the_same_local_model_does(cache, capsys):
    """`qwen4exp generate --model org/tiny` gives the tokens `--model tiny` gives: the id is the same checkpoint,
    found where huggingface_hub keeps it, and loaded through the profile and engine as any path is."""
    from qwen4exp.cli import main

    cache_repo(cache, "org/tiny", {p.name: p for p in EMBEDDED_MODEL.iterdir()})
    argv = ["generate", "--prompt", "In the beginning", "--max-tokens", "6", "--greedy", "--ignore-eos", "--json"]
    answers = []
    for model in ("tiny", "org/tiny"):
        assert main(argv + ["--model", model]) == 0
        answers.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert answers[0] == answers[1] and len(answers[0]) == 6


def test_the_environment_alone_names_the_cache_and_offline_mode(cache, tmp_path):
    """A fresh process started with HF_HUB_CACHE and HF_HUB_OFFLINE=1 (huggingface_hub reads them at import) finds an
    id in that cache and, for one not there, says so naming that cache."""
    snapshot = cache_repo(cache, "org/tiny", {p.name: p for p in EMBEDDED_MODEL.iterdir()})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QWEN4EXP_", "HF_"))}
    env |= {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(DAEMON)}
    script = "import sys; from qwen4exp.model_dir import resolve_model; print(resolve_model(sys.argv[1]))"
    found = subprocess.run([sys.executable, "-c", script, "org/tiny"], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=120)
    assert found.returncode == 0 and Path(found.stdout.strip()) == snapshot, found.stderr
    absent = subprocess.run([sys.executable, "-c", script, "org/absent:Q8_0"], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=120)
    assert absent.returncode == 1
    assert absent.stderr.strip() == (f"error: model 'org/absent:Q8_0': org/absent is not in the Hugging Face cache at "
                                     f"{cache}, and HF_HUB_OFFLINE is set (unset it to download)")


def test_a_heads_release_is_fetched_without_its_other_shards(cache, monkeypatch, caplog):
    """`mtp_weights = "org/release"` (model_dir.resolve_head): the release's small files first, then of its weights
    only the shards its index lists for mtp.* (a GGUF user's few GB of Qwen's hundreds), said in the log; an index
    without the head, or a GGUF quant named for it, is refused in words."""
    from qwen4exp.model_dir import resolve_head

    gib = 2**30
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00003.safetensors",
                            "mtp.fc_hidden.weight": "model-00003-of-00003.safetensors",
                            "mtp.layers.0.mlp.gate.weight": "model-00003-of-00003.safetensors",
                            "model.layers.0.mlp.gate.weight": "model-00002-of-00003.safetensors"}}
    shards = {f"model-0000{n}-of-00003.safetensors": "x" for n in (1, 2, 3)}
    headless = {"weight_map": {"model.norm.weight": "model-00001-of-00003.safetensors"}}
    repos = {repo: {"config.json": "{}", "model.safetensors.index.json": json.dumps(its), "README.md": "text", **shards}
             for repo, its in (("org/release", index), ("org/headless", headless))}
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, **kw: SimpleNamespace(
        sha=COMMIT, siblings=[SimpleNamespace(rfilename=n, size=gib) for n in repos[repo]]))
    asked = []

    def download(repo_id, **kwargs):
        import fnmatch
        asked.append(kwargs["allow_patterns"])
        snapshot = Path(kwargs["cache_dir"]) / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        return str(cache_repo(Path(kwargs["cache_dir"]), repo_id, {n: c for n, c in repos[repo_id].items() if any(
            fnmatch.fnmatch(n, p) for p in kwargs["allow_patterns"]) and not (snapshot / n).exists()}))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    with caplog.at_level(logging.INFO, logger="qwen4exp.hub"):
        path = resolve_head("org/release")
    assert path == cache / "models--org--release" / "snapshots" / COMMIT
    assert asked == [["config.json", "model.safetensors.index.json"],
                     ["config.json", "model-00003-of-00003.safetensors", "model.safetensors.index.json"]]
    assert not (path / "model-00001-of-00003.safetensors").exists()
    assert "downloading org/release into" in caplog.text and "model-00003-of-00003.safetensors" in caplog.text
    with pytest.raises(SystemExit, match=r"org/release:Q8_0 names GGUF files \(:Q8_0\); the tensors come from a "
                                         r"safetensors checkpoint: write org/release"):
        resolve_head("org/release:Q8_0")
    with pytest.raises(SystemExit, match=r"mtp_weights 'org/headless': org/headless: its model.safetensors.index.json "
                                         r"lists no tensor named mtp\.\*"):
        resolve_head("org/headless")

"""Hugging Face ids to local paths, through huggingface_hub and its cache.

`org/repo` names a safetensors checkpoint: the config, weights, index, tokenizer, chat template and the other small
json/jinja/txt files at the top of the repo are fetched, and the model is the snapshot directory. `org/repo:QUANT`
names the GGUF files of one quantization, picked as llama.cpp's `-hf` picks them (the tag in the file's path, in any
case): only those files are fetched, and the model is the first (or only) one, since the GGUF loader finds a split
set's other shards beside its first. `@revision` after either pins a branch, tag or commit.

huggingface_hub decides where files live and who may read them: HF_HOME / HF_HUB_CACHE (the cache), HF_TOKEN (gated
and private repos), HF_HUB_OFFLINE=1 (the cache only). It reads them once, when it is first imported, so a process
goes by the values it started with; everything here asks its `constants` for them rather than the environment, so
what this module lists and what huggingface_hub downloads always agree. It is imported only when an id is resolved:
a process that serves a local directory never loads it.
"""

from __future__ import annotations

import glob
import logging
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

log = logging.getLogger("qwen4exp.hub")

# An id always has its owner: a bare word is a local name (`tiny`), never a repo. Names as the Hub allows them (letters,
# digits, `-`, `_`, `.`, at most 96), then an optional `:QUANT` and an optional `@revision` (a branch may hold `/`).
_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})"
                 r"(?::(?P<quant>[\w.+-]+))?(?:@(?P<revision>[\w./-]+))?", re.ASCII)
_COMMIT = re.compile(r"[0-9a-f]{40}")
# The loader's own rule for a split set (checkpoint/gguf_file.py): the first shard opens the rest.
_SHARD = re.compile(r"(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
# The quantization a GGUF's name says, only to tell a user which quants a repo has: Q8_0, UD-Q4_K_XL, IQ2_XXS, BF16...
_QUANT_NAME = re.compile(r"(?<![A-Za-z0-9])(?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|TQ\d_\d|MXFP4(?:_MOE)?|BF16|F16|F32)"
                         r"(?![A-Za-z0-9])", re.IGNORECASE)
# What a safetensors checkpoint needs from the top of its repo; subfolders (original/, onnx/, ...) are other formats.
_CHECKPOINT_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt")
_LISTED = 8     # file names a message or log line spells out before it says "and N more"


class HubError(Exception):
    """Why an id could not be resolved, in words for the user: the id, the quant, the cache directory."""


@dataclass(frozen=True)
class HubId:
    repo: str                       # owner/name
    quant: str | None = None        # a GGUF quantization tag, as the user wrote it
    revision: str | None = None     # branch, tag or commit; None: the repo's default branch

    @classmethod
    def parse(cls, name: str) -> HubId | None:
        """The id `name` spells, or None when it is not shaped like one. `x/y.gguf` reads as a file, not a repo."""
        match = _ID.fullmatch(name.strip())
        if match is None or name.strip().endswith(".gguf"):
            return None
        repo = match["repo"]
        # The Hub refuses these in a name; they are more likely a path typed wrong than an id.
        if "--" in repo or ".." in repo or repo.endswith((".", "-")):
            return None
        return cls(repo, match["quant"], match["revision"])

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "") + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class Located:
    """The files an id needs and where they live (or will live) in the cache; nothing downloaded yet."""
    hub_id: HubId
    cache: Path
    snapshot: Path                      # the commit's directory in the cache (absent until something is fetched)
    files: tuple[str, ...]              # repo paths; for a GGUF the first shard comes first
    sizes: dict[str, int | None]        # bytes per file where the listing said
    gguf: bool
    cache_only: str | None = None       # why nothing can be downloaded now (offline, the Hub unreachable); None: it can

    @property
    def path(self) -> Path:
        """What the loader opens: the snapshot directory, or the first GGUF file in it."""
        return self.snapshot / self.files[0] if self.gguf else self.snapshot

    @property
    def missing(self) -> list[str]:
        # is_file follows the snapshot's symlink into blobs/: a link whose blob is gone counts as missing.
        return [name for name in self.files if not (self.snapshot / name).is_file()]

    def size_of(self, names: list[str]) -> int | None:
        sizes = [self.sizes.get(name) for name in names]
        return None if any(size is None for size in sizes) else sum(sizes)


@dataclass(frozen=True)
class _Listing:
    commit: str
    files: dict[str, int | None]        # every file of the repo known at that commit, with its size when known
    cache_only: str | None = None       # why it was read from the cache rather than asked of the Hub


@dataclass(frozen=True)
class _GGUFSet:
    files: tuple[str, ...]              # one file, or the shards of a split set in order
    complete: bool                      # False: a split set with shards missing from the listing

    @property
    def stem(self) -> str:
        split = _SHARD.fullmatch(self.files[0])
        return split["stem"] if split else self.files[0].removesuffix(".gguf")

    @property
    def label(self) -> str:
        """The quant its name says (the last one, past a model name that looks like one), else the name itself."""
        name = PurePosixPath(self.stem).name
        found = _QUANT_NAME.findall(name)
        return found[-1] if found else name

    def describe(self) -> str:
        count = len(self.files) if self.complete else int(_SHARD.fullmatch(self.files[0])["count"])
        return self.files[0] + (f" ({count} files)" if count > 1 else "")


def cache_dir() -> Path:
    """huggingface_hub's cache: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE).expanduser()


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub read it: the cache only, no request at all."""
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def locate(hub_id: HubId, keep=None) -> Located:
    """The files `hub_id` needs and where they are in the cache, from the Hub's listing of the repo, or from the
    cache when offline or when the Hub cannot be asked. Downloads nothing. Raises HubError. `keep`: a test on repo
    paths that narrows a checkpoint's files (resolve_tensors)."""
    cache = cache_dir()
    listing = _listing(hub_id, cache)
    try:
        files, gguf = _select(hub_id, listing)
        files = [name for name in files if keep is None or keep(name)]
    except HubError as err:
        if listing.cache_only is None:
            raise
        # The cache may hold only part of the repo: say the choice was made from what it lists.
        raise HubError(f"{err} (as the cache at {cache} lists it; {listing.cache_only})") from None
    snapshot = cache / _repo_folder(hub_id.repo) / "snapshots" / listing.commit
    return Located(hub_id, cache, snapshot, tuple(files), {name: listing.files.get(name) for name in files}, gguf,
                   listing.cache_only)


def resolve(hub_id: HubId, keep=None) -> Path:
    """The local path of `hub_id` (a snapshot directory or a GGUF file in the cache), downloading what the cache
    lacks through huggingface_hub, whose progress bars go to stderr. Raises HubError. `keep`: as locate's."""
    from huggingface_hub import snapshot_download

    found = locate(hub_id, keep)
    missing = found.missing
    if missing and found.cache_only:
        raise HubError(f"{hub_id}: {_names(missing)} not in the Hugging Face cache at {found.cache}, and "
                       f"{found.cache_only}")
    if missing:
        size = found.size_of(missing)
        log.info("downloading %s into %s: %d file%s%s: %s", hub_id, found.cache, len(missing),
                 "" if len(missing) == 1 else "s", "" if size is None else f", {_human(size)}", _names(missing))
    # Exact names, escaped: allow_patterns are fnmatch patterns, and only the chosen files may come. A download names
    # the user's revision (not the commit) so huggingface_hub records refs/<branch> for a later offline start; with
    # everything cached, the commit listed pins the very snapshot whose files were counted, and no request is made.
    try:
        folder = Path(snapshot_download(hub_id.repo, revision=hub_id.revision if missing else found.snapshot.name,
                                        cache_dir=str(found.cache), local_files_only=not missing,
                                        allow_patterns=[glob.escape(name) for name in found.files]))
    except Exception as err:     # noqa: BLE001 - every failure becomes a message; only what it says differs
        raise _failed(hub_id, err, found.cache, f"downloading it into {found.cache} failed") from None
    if folder.resolve() == found.snapshot.resolve():
        folder = found.snapshot          # the cache as HF_HUB_CACHE spells it, not huggingface_hub's resolved spelling
    absent = [name for name in found.files if not (folder / name).is_file()]
    if absent:
        raise HubError(f"{hub_id}: {_names(absent)} not in {folder} after the download (did the repo change "
                       f"meanwhile? run again)")
    return folder / found.files[0] if found.gguf else folder


def resolve_tensors(hub_id: HubId, prefix: str) -> Path:
    """The snapshot directory of a safetensors checkpoint holding its small files and, of its weights, only the
    shards its index lists for tensors named `prefix`* (a GGUF's MTP head from Qwen's release: a few GB of its
    hundreds); what the cache lacks is downloaded. Raises HubError."""
    import json

    if hub_id.quant is not None:
        raise HubError(f"{hub_id} names GGUF files (:{hub_id.quant}); the tensors come from a safetensors checkpoint: "
                       f"write {hub_id.repo}" + (f"@{hub_id.revision}" if hub_id.revision else ""))
    small = resolve(hub_id, keep=lambda name: not name.endswith(".safetensors"))
    index = small / "model.safetensors.index.json"
    if not index.is_file():                    # one model.safetensors: there is nothing to leave out
        return resolve(hub_id)
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise HubError(f"{hub_id}: {index.name} is not a safetensors index ({err})") from None
    shards = {file for name, file in weight_map.items() if name.startswith(prefix)}
    if not shards:
        raise HubError(f"{hub_id}: its {index.name} lists no tensor named {prefix}*")
    return resolve(hub_id, keep=lambda name: not name.endswith(".safetensors") or name in shards)


# ---- listing ------------------------------------------------------------------------------------------------------

def _listing(hub_id: HubId, cache: Path) -> _Listing:
    if offline():
        return _cached_listing(hub_id, cache, "HF_HUB_OFFLINE is set (unset it to download)")
    from huggingface_hub import HfApi
    try:
        info = HfApi().model_info(hub_id.repo, revision=hub_id.revision, files_metadata=True)
    except Exception as err:     # noqa: BLE001 - like huggingface_hub's own downloads: the cache, if it has the id
        try:
            listing = _cached_listing(hub_id, cache, f"the Hub could not be asked ({_brief(err)})")
        except HubError:
            raise _failed(hub_id, err, cache, f"the Hub could not be asked ({_brief(err)}) and the cache at "
                                              f"{cache} does not hold it") from None
        log.warning("%s: the Hugging Face Hub could not be asked (%s); using what the cache at %s holds",
                    hub_id, _brief(err), cache)
        return listing
    return _Listing(info.sha, {sibling.rfilename: sibling.size for sibling in info.siblings or ()})


def _cached_listing(hub_id: HubId, cache: Path, why: str) -> _Listing:
    """The repo as the cache knows it (`why`: the reason only the cache is read): refs/<revision> names the commit,
    snapshots/<commit>/ holds its files. The whole listing comes from the tree huggingface_hub keeps beside them when
    it has one (so a file not downloaded is known to exist), else it is what is on disk."""
    storage = cache / _repo_folder(hub_id.repo)
    revision = hub_id.revision or "main"
    commit = revision if _COMMIT.fullmatch(revision) else None
    if commit is None and (storage / "refs" / revision).is_file():
        commit = (storage / "refs" / revision).read_text().strip()
    if commit is None or not (storage / "snapshots" / commit).is_dir():
        at = f" at revision {revision!r}" if hub_id.revision else ""
        raise HubError(f"{hub_id.repo}{at} is not in the Hugging Face cache at {cache}, and {why}")
    files = _cached_tree(hub_id.repo, commit, cache)
    if files is None:
        snapshot = storage / "snapshots" / commit
        files = {path.relative_to(snapshot).as_posix(): path.stat().st_size
                 for path in sorted(snapshot.rglob("*")) if path.is_file()}
    return _Listing(commit, files, why)


def _cached_tree(repo: str, commit: str, cache: Path) -> dict[str, int | None] | None:
    try:
        from huggingface_hub import get_cached_repo_tree
        from huggingface_hub.errors import CachedRepoTreeNotFoundError
    except ImportError:          # a huggingface_hub without the tree cache: what is on disk is all that is known
        return None
    try:
        return {entry.path: entry.size for entry in get_cached_repo_tree(repo, revision=commit, cache_dir=str(cache))}
    except CachedRepoTreeNotFoundError:
        return None


def _repo_folder(repo: str) -> str:
    from huggingface_hub.file_download import repo_folder_name
    return repo_folder_name(repo_id=repo, repo_type="model")


# ---- choosing the files -------------------------------------------------------------------------------------------

def _select(hub_id: HubId, listing: _Listing) -> tuple[list[str], bool]:
    """(the repo paths to fetch, whether they are a GGUF)."""
    sets = _gguf_sets(listing.files)
    if hub_id.quant is not None:
        chosen = _pick_quant(hub_id, sets, listing)
        return list(chosen.files), True
    top = [name for name in listing.files if "/" not in name]
    if "config.json" in top and any(name.endswith(".safetensors") for name in top):
        return sorted(name for name in top if name.endswith(_CHECKPOINT_SUFFIXES)), False
    whole = [s for s in sets if s.complete]
    if len(whole) == 1:
        log.info("%s holds no safetensors checkpoint but GGUF files of one quant, %s: using %s", hub_id,
                 whole[0].label, whole[0].describe())
        return list(whole[0].files), True
    if whole:
        raise HubError(f"{hub_id.repo} holds GGUF files of several quants; name one, e.g. "
                       f"{_with_quant(hub_id, whole[0].label)} (its quants: {_labels(whole)})")
    raise HubError(f"{hub_id.repo} holds neither a safetensors checkpoint (config.json and *.safetensors at its "
                   f"top) nor GGUF files, so qwen4exp cannot load it; its files: {_names(sorted(listing.files))}")


def _gguf_sets(files: dict[str, int | None]) -> list[_GGUFSet]:
    """The repo's GGUF models: single files and split sets (a set is one model, shards in order). mmproj files are
    vision projectors that go with a model, never a model themselves, so they are left out as llama.cpp does."""
    singles, splits = [], {}
    for name in sorted(files):
        base = PurePosixPath(name).name
        if not base.endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        split = _SHARD.fullmatch(name)
        if split is None:
            singles.append(_GGUFSet((name,), True))
        else:
            splits.setdefault((split["stem"], int(split["count"])), {})[int(split["no"])] = name
    sets = [_GGUFSet(tuple(shards[no] for no in sorted(shards)), sorted(shards) == list(range(1, count + 1)))
            for (_, count), shards in splits.items()]
    return sorted(singles + sets, key=lambda s: s.files[0])


def _pick_quant(hub_id: HubId, sets: list[_GGUFSet], listing: _Listing) -> _GGUFSet:
    """The set whose path holds the tag, in any case. Where several do, a tag that is a whole word of the name wins
    (Q6_K is not the Q6_K of UD-Q6_K_XL), then one that is the quant's whole name (Q8_0 over UD-Q8_0), then a
    complete split set over a broken one; what is left ambiguous is refused, never guessed."""
    if not sets:
        raise HubError(f"{hub_id.repo} has no GGUF files; if it is a safetensors checkpoint, name it without "
                       f"':{hub_id.quant}' (its files: {_names(sorted(listing.files))})")
    tag = hub_id.quant.lower()
    word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
    found = [s for s in sets if tag in s.files[0].lower()]
    for narrower in (lambda s: word.search(s.files[0]) is not None, lambda s: s.label.lower() == tag,
                     lambda s: s.complete):
        if len(found) > 1:
            found = [s for s in found if narrower(s)] or found
    if not found:
        raise HubError(f"{hub_id.repo} has no GGUF files of quant {hub_id.quant!r}; its quants: {_labels(sets)} "
                       f"(e.g. {_with_quant(hub_id, sets[0].label)})")
    if len(found) > 1:
        raise HubError(f"{hub_id} matches more than one GGUF model: {'; '.join(s.describe() for s in found)}; "
                       f"name the quant more exactly")
    if not found[0].complete:
        chosen = found[0]
        have = ", ".join(str(int(_SHARD.fullmatch(name)["no"])) for name in chosen.files)
        raise HubError(f"{hub_id}: the split set {chosen.stem} is incomplete: only shards {have} of "
                       f"{int(_SHARD.fullmatch(chosen.files[0])['count'])} are listed")
    return found[0]


def _labels(sets: list[_GGUFSet]) -> str:
    return ", ".join(dict.fromkeys(s.label for s in sets))


def _with_quant(hub_id: HubId, quant: str) -> str:
    return str(HubId(hub_id.repo, quant, hub_id.revision))


# ---- messages ----------------------------------------------------------------------------------------------------

def _failed(hub_id: HubId, err: Exception, cache: Path, otherwise: str) -> HubError:
    """A user's mistake said plainly (huggingface_hub's exceptions name it); any other failure as `otherwise`."""
    from huggingface_hub import constants
    from huggingface_hub.utils import (GatedRepoError, HFValidationError, RepositoryNotFoundError,
                                       RevisionNotFoundError)

    repo, who = hub_id.repo, _who()
    if isinstance(err, GatedRepoError):      # before its base class, RepositoryNotFoundError
        return HubError(f"{repo} is a gated repository and {who} has no access to it: ask for it at "
                        f"{constants.ENDPOINT}/{repo}, then set HF_TOKEN to a token of that account; it is not in "
                        f"the cache at {cache} either")
    if isinstance(err, RepositoryNotFoundError):
        return HubError(f"there is no model repository {repo} on the Hugging Face Hub that {who} can read (a typo? "
                        f"a private repo needs HF_TOKEN), no local path of that name, and nothing in the cache at "
                        f"{cache}")
    if isinstance(err, RevisionNotFoundError):
        return HubError(f"{repo} has no revision {hub_id.revision!r} on the Hugging Face Hub")
    if isinstance(err, HFValidationError):
        return HubError(f"{hub_id.repo!r} is not a valid Hugging Face repo id ({_brief(err)}), nor a local path")
    return HubError(f"{hub_id}: {otherwise}")


def _who() -> str:
    from huggingface_hub import get_token
    return "the token in use" if get_token() else "an anonymous request (no HF_TOKEN)"


def _brief(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def _names(names: list[str]) -> str:
    more = len(names) - _LISTED
    return ", ".join(names[:_LISTED]) + (f" and {more} more" if more > 0 else "")


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"

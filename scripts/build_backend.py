"""The build backend (PEP 517): maturin's, with the operator's files placed inside the package in the wheel.

The shipped profiles and the systemd unit sit at the top of the repository (profiles/, systemd/), where an
operator looks for them; an installed daemon reads them from its package (qwen4exp/profiles/, qwen4exp/systemd/).
maturin's `include` keeps a file's path relative to the repository and has no destination for it, so it cannot put
them there: build_wheel adds them to the wheel maturin wrote. An editable install is maturin's own and carries
none of them: the package finds the repository's folders beside it (qwen4exp.config.sources.shipped_dir).
`maturin build` run by hand skips this backend; build a wheel with `pip wheel .` or `python -m build`.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import maturin
from maturin import (
    build_editable,
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_wheel,
)

# The PEP 517 hooks: maturin's, but build_wheel.
__all__ = ["build_editable", "build_sdist", "build_wheel", "get_requires_for_build_editable",
           "get_requires_for_build_sdist", "get_requires_for_build_wheel", "prepare_metadata_for_build_wheel"]

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "qwen4exp"
OPERATOR_FILES = ("profiles/*.toml", "systemd/*.service")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = {}
    for pattern in OPERATOR_FILES:
        found = sorted(ROOT.glob(pattern))
        if not found:
            raise RuntimeError(f"nothing under {ROOT} matches {pattern}: the wheel would ship without it")
        files |= {f"{PACKAGE}/{path.relative_to(ROOT).as_posix()}": path for path in found}
    name = maturin.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_to_wheel(Path(wheel_directory) / name, files)
    return name


def add_to_wheel(wheel: Path, files: dict[str, Path]) -> None:
    """Rewrite `wheel` with `files` (name in the wheel -> file) added and listed in its RECORD, each with its
    sha256 (urlsafe base64, unpadded) and size as the wheel format asks; the .dist-info stays last."""
    rewritten = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(wheel) as old, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as new:
        entries = old.infolist()
        clash = sorted(set(files) & {entry.filename for entry in entries})
        if clash:
            raise RuntimeError(f"{wheel.name} already holds {', '.join(clash)}: one copy of each file, at the top")
        metadata = [entry for entry in entries if ".dist-info/" in entry.filename]
        for entry in entries:
            if ".dist-info/" not in entry.filename:
                new.writestr(entry, old.read(entry))
        added = []
        for name, path in files.items():
            data = path.read_bytes()
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))   # reproducible, as maturin writes
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            new.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            added.append(f"{name},sha256={digest},{len(data)}")
        for entry in metadata:
            data = old.read(entry)
            if entry.filename.endswith(".dist-info/RECORD"):
                data = ("\n".join(added) + "\n").encode() + data
            new.writestr(entry, data)
    rewritten.replace(wheel)

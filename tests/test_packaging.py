"""The wheel, installed as an operator installs it (not editable), carries what sits at the top of the repository
for operators: `qwen4exp profiles` lists the shipped profiles from inside the installed package, each one loads,
the default profile is found, and `install-service` writes the shipped systemd unit."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: object, **kwargs) -> str:
    result = subprocess.run([str(a) for a in args], check=False, capture_output=True, text=True, **kwargs)
    command = " ".join(map(str, args))
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _with_maturin_on_path(env: dict[str, str]) -> dict[str, str]:
    """maturin's backend runs the `maturin` program found on PATH: the folder pip put the test extra's copy in
    comes first, as it need not be on PATH (a --user install, say)."""
    distribution = metadata.distribution("maturin")
    program = next(Path(distribution.locate_file(f)) for f in distribution.files or [] if f.name == "maturin")
    return {**env, "PATH": f"{program.resolve().parent}{os.pathsep}{env.get('PATH', '')}"}


def test_an_installed_wheel_carries_the_profiles_and_the_systemd_unit(tmp_path):
    tmp_path = tmp_path.resolve()                     # the daemon prints resolved paths; compare like with like
    shipped = sorted(path.stem for path in (ROOT / "profiles").glob("*.toml"))
    assert "tiny" in shipped, f"no shipped profiles under {ROOT / 'profiles'}"
    # pip runs the project's build backend as any installer would; without build isolation it uses the maturin
    # of the test extra instead of downloading one, and cargo reuses the editable install's build of the core.
    _run(sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
         env=_with_maturin_on_path(dict(os.environ)))
    (wheel,) = (tmp_path / "dist").glob("qwen4exp-*.whl")
    site = tmp_path / "site"
    _run(sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, wheel)

    etc = tmp_path / "etc"                            # stands for /etc/qwen4exp, empty: nothing shadows a shipped file
    etc.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith("QWEN4EXP_")}
    env.update(PYTHONPATH=str(site), QWEN4EXP_PROFILE_PATH=str(etc))

    def qwen4exp(*args: object) -> str:           # from a directory without the checkout's daemon/ in it
        return _run(sys.executable, "-m", "qwen4exp", *args, cwd=tmp_path, env=env)

    package = site / "qwen4exp"
    imported = _run(sys.executable, "-c", "import qwen4exp; print(qwen4exp.__file__)", cwd=tmp_path, env=env)
    assert Path(imported.strip()) == package / "__init__.py", "the installed wheel, not the checkout, must run"

    listed = qwen4exp("profiles").splitlines()
    names = [line.split()[0] for line in listed if line and not line[0].isspace()]
    paths = [Path(line.strip()) for line in listed if line[:1].isspace()]
    assert names == shipped
    assert paths == [package / "profiles" / f"{name}.toml" for name in shipped]
    for name in shipped:
        shown = qwen4exp("profiles", "show", "--profile", name)
        assert f"profile {package / 'profiles' / f'{name}.toml'}" in shown, shown
    assert f"profile {package / 'profiles' / 'tiny.toml'}" in qwen4exp("profiles", "show")   # what `serve` loads

    root = tmp_path / "root"
    qwen4exp("install-service", "--root", root, "--user", "svc", "--profile", "tiny")
    template = (ROOT / "systemd" / "qwen4exp.service").read_text()
    expected = (template.replace("@EXEC@", f"{shlex.quote(sys.executable)} -m qwen4exp")
                .replace("@USER@", "svc").replace("@PROFILE@", "tiny"))
    assert (root / "etc/systemd/system/qwen4exp.service").read_text() == expected

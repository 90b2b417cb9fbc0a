"""systemd integration: sd_notify over a real unix datagram socket, and the unit as systemd reads it."""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from qwen4exp.server.sd_notify import Notifier
from qwen4exp.service_install import install, unit_text
from datagrams import until_quiet


def test_notify_sends_datagrams_to_the_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        notifier = Notifier()
        assert notifier.notify(READY=1, STATUS="serving on 127.0.0.1:8077, context 4096")
        assert server.recv(4096) == b"READY=1\nSTATUS=serving on 127.0.0.1:8077, context 4096"
        notifier.notify(WATCHDOG=1)
        assert server.recv(4096) == b"WATCHDOG=1"


def test_fetching_the_model_extends_systemds_start_timeout_until_it_ends(tmp_path):
    """A model fetched from the Hub before the engine loads can take longer than TimeoutStartSec: while it runs,
    systemd is told to wait longer (EXTEND_TIMEOUT_USEC), with the reason in STATUS; after it, nothing more."""
    import time

    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        server.settimeout(2)
        with Notifier(path).extending_start("fetching the model org/repo", every=0.05):
            time.sleep(0.3)
        got = until_quiet(server, 0.2)
    assert len(got) >= 3 and set(got) == {b"EXTEND_TIMEOUT_USEC=150000\nSTATUS=fetching the model org/repo"}


def test_notify_is_a_no_op_outside_systemd(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not Notifier().notify(READY=1)


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "60000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert Notifier("/nonexistent").watchdog_interval() == 30.0


def test_unit_is_type_notify_with_a_watchdog_and_hardening():
    text = unit_text("qwen4exp", "h200", executable="/usr/bin/env qwen4exp")
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "User=qwen4exp", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ExecStart=/usr/bin/env qwen4exp serve --profile h200"):
        assert line in text


def test_a_profile_path_with_spaces_stays_one_argument_and_names_that_break_the_unit_are_refused(tmp_path,
                                                                                                monkeypatch):
    profile = tmp_path / "my profile 100%.toml"
    profile.write_text('model = "tiny"\n')
    unit = unit_text("qwen4exp", str(profile), executable="/usr/bin/env qwen4exp")
    assert f'ExecStart=/usr/bin/env qwen4exp serve --profile "{tmp_path}/my profile 100%%.toml"\n' in unit
    with pytest.raises(ValueError, match="control character"):
        unit_text("qwen4exp", "h200\nUser=root")
    with pytest.raises(ValueError, match="not a system user's name"):
        unit_text("", "h200")
    with pytest.raises(ValueError, match="no profile named 'nonexistent'"):
        install(user="svc", profile="nonexistent", root=str(tmp_path), find=True)
    assert not (tmp_path / "etc").exists()                # nothing written
    monkeypatch.chdir(tmp_path)                           # a relative path is written as the file it names here
    install(user="svc", profile="my profile 100%.toml", root=str(tmp_path / "root"), find=True)
    unit = (tmp_path / "root/etc/systemd/system/qwen4exp.service").read_text()
    assert f'--profile "{tmp_path}/my profile 100%%.toml"' in unit


def test_install_into_a_root_dir_writes_the_unit_and_a_private_env_file(tmp_path):
    done = install(user="svc", profile="tiny", root=str(tmp_path))
    unit = tmp_path / "etc/systemd/system/qwen4exp.service"
    env = tmp_path / "etc/qwen4exp/qwen4exp.env"
    assert unit.exists() and "serve --profile tiny" in unit.read_text() and len(done) == 2
    assert env.stat().st_mode & 0o777 == 0o600


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    unit = tmp_path / "qwen4exp.service"
    unit.write_text(unit_text("root", "tiny", executable=shutil.which("python3") + " -m qwen4exp"))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "qwen4exp.service" not in result.stderr, result.stderr

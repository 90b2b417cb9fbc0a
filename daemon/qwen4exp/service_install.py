"""`qwen4exp install-service`: install the systemd unit (Type=notify) for this installation.

Writes /etc/systemd/system/qwen4exp.service with ExecStart pointing at this Python, an environment file
for the keys (/etc/qwen4exp/qwen4exp.env, mode 0600, kept if present), creates the system user, and
reloads systemd. `--root DIR` writes under DIR and runs nothing (for packaging and tests).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .config.errors import ConfigError
from .config.sources import find_profile, is_path, shipped_dir

ENV_TEMPLATE = """# Keys for qwen4exp (read by systemd; keep this file mode 0600).
# QWEN4EXP_API_KEY=
# QWEN4EXP_ADMIN_KEY=
"""


# useradd's rule for a system user's name (and systemd's for User=): no spaces, no line breaks, nothing to expand.
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


def systemd_word(text: str) -> str:
    """`text` as one word of an ExecStart= line: where it needs it, double-quoted with systemd's specifiers (%) and
    variable expansion ($) escaped, so a path with spaces stays one argument."""
    if any(ord(c) < 32 for c in text):
        raise ValueError(f"{text!r} has a control character (a line break?), which a unit file cannot hold")
    if re.fullmatch(r"[A-Za-z0-9_./:+@=,-]+", text):
        return text                                  # nothing systemd reads otherwise
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def unit_text(user: str, profile: str, executable: str | None = None) -> str:
    if not _USER.fullmatch(user):
        raise ValueError(f"--user {user!r} is not a system user's name (letters, digits, _, . and -, starting "
                         f"with a letter or _)")
    template = (shipped_dir("systemd") / "qwen4exp.service").read_text()
    exec_start = executable or f"{systemd_word(sys.executable)} -m qwen4exp"
    return template.replace("@EXEC@", exec_start).replace("@USER@", user).replace("@PROFILE@",
                                                                                   systemd_word(profile))


def install(user: str = "qwen4exp", profile: str = "h200", root: str | None = None,
            find: bool | None = None) -> list[str]:
    """Install; returns what was done, one line each. `find` (default: without `root`, where the profile must be
    this machine's) looks the profile up first and writes a path as the file found."""
    if find if find is not None else not root:      # a unit naming no profile would fail at every start
        try:
            found = find_profile(profile)
        except ConfigError as err:
            raise ValueError(f"--profile: {err}") from None
        # The service starts in /, as another user: a path is written as the file found here.
        profile = str(found) if is_path(profile) else profile
    text = unit_text(user, profile)
    base = Path(root) if root else Path("/")
    done = []
    unit = base / "etc/systemd/system/qwen4exp.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(text)
    done.append(f"wrote {unit}")
    env = base / "etc/qwen4exp/qwen4exp.env"
    env.parent.mkdir(parents=True, exist_ok=True)
    if not env.exists():
        env.write_text(ENV_TEMPLATE)
        env.chmod(0o600)
        done.append(f"wrote {env} (mode 0600): put the API and admin keys there")
    if root:
        return done
    try:
        pwd.getpwnam(user)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user], check=True)
        done.append(f"created the system user {user}")
    if shutil.which("systemctl") and os.path.isdir("/run/systemd/system"):
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        done.append("reloaded systemd; start it with: systemctl enable --now qwen4exp")
    return done

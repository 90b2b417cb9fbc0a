"""`qwen4exp install-service`: install the systemd unit (Type=notify) for this installation.

Writes /etc/systemd/system/qwen4exp.service with ExecStart pointing at this Python, an environment file
for the keys (/etc/qwen4exp/qwen4exp.env, mode 0600, kept if present), creates the system user, and
reloads systemd. `--root DIR` writes under DIR and runs nothing (for packaging and tests).
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .config.sources import shipped_dir

ENV_TEMPLATE = """# Keys for qwen4exp (read by systemd; keep this file mode 0600).
# QWEN4EXP_API_KEY=
# QWEN4EXP_ADMIN_KEY=
"""


def unit_text(user: str, profile: str, executable: str | None = None) -> str:
    template = (shipped_dir("systemd") / "qwen4exp.service").read_text()
    exec_start = executable or f"{shlex.quote(sys.executable)} -m qwen4exp"
    return template.replace("@EXEC@", exec_start).replace("@USER@", user).replace("@PROFILE@", profile)


def install(user: str = "qwen4exp", profile: str = "h200", root: str | None = None) -> list[str]:
    """Install; returns what was done, one line each."""
    base = Path(root) if root else Path("/")
    done = []
    unit = base / "etc/systemd/system/qwen4exp.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(unit_text(user, profile))
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

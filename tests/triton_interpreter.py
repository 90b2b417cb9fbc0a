"""Run a kernel test's checks under Triton's CPU interpreter: in a child process, because TRITON_INTERPRET must
be set before Triton is imported (and this pytest process may have imported it already)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def interpreted_results(child_code: str, timeout: float = 600) -> dict:
    """Runs `child_code` with TRITON_INTERPRET=1; returns the JSON object its last printed line holds."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", child_code], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

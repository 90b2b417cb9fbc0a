#!/usr/bin/env python3
"""Plant small bugs, one at a time, and check that the suite catches each: the test of the tests.

    python3 scripts/mutation_check.py                 # every mutant; a table on stdout, exit 1 if one survives
    python3 scripts/mutation_check.py --only fifo     # mutants whose name contains "fifo"

Each mutant is one exact edit of one file (its `old` text must occur there exactly once, so a refactor that moves
the code makes the script say so instead of planting nothing). The file is restored after its run, whatever
happens. A Rust mutant rebuilds the extension (pip install -e .) before its tests and after the restore. The tests
named with a mutant are the ones expected to catch it; the run says which of them failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE, SAMPLING, FIT = "daemon/qwen4exp/engine/engine.py", "daemon/qwen4exp/engine/sampling.py", \
    "daemon/qwen4exp/engine/fit.py"
ERRORS, RUNNER, SERVE = "daemon/qwen4exp/server/errors.py", "daemon/qwen4exp/server/runner.py", \
    "daemon/qwen4exp/server/serve.py"
RADIX, STORE = "rust_core/core/src/prefix_store/radix.rs", "rust_core/core/src/prefix_store/mod.rs"
CACHE = "daemon/qwen4exp/engine/prefix_cache.py"
SERVER_TESTS = ["tests/test_server.py", "tests/test_reliability.py"]


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("chunk-grid", "prompt chunks are cut shorter while another slot decodes (a load-dependent grid)", ENGINE,
           "            end = min(len(slot.request.prompt_ids), (slot.prefilled // self.chunk + 1) * self.chunk)\n",
           "            end = min(len(slot.request.prompt_ids), (slot.prefilled // self.chunk + 1) * self.chunk)\n"
           "            if any(s.decoding for s in self.pool.slots):\n"
           "                end = min(end, slot.prefilled + self.chunk // 2)\n", ("tests/test_engine.py",)),
    Mutant("beside-batch", "decode steps beside a batch of prompt chunks write idle rows inside all but one chunk",
           ENGINE, "{c.slot.index: c.end for c in chunks}", "{chunks[0].slot.index: chunks[0].end}",
           ("tests/test_engine.py",)),
    Mutant("snapshot-copy-race", "a slot's next request starts before its last snapshots' copies are queued",
           ENGINE, "            self.prefix_cache.wait_for_captures(slot.state)\n", "            pass\n",
           ("tests/test_prefix_cache.py",)),
    Mutant("off-grid-continue", "a longer prompt continues from a restore point off the chunk grid", CACHE,
           "while entry is not None and entry.length % grid and entry.length != len(prompt_ids):",
           "while False:", ("tests/test_prefix_cache.py",)),
    Mutant("fifo", "admission takes the newest queued request first", ENGINE,
           "request = self._queue.popleft()", "request = self._queue.pop()", ("tests/test_engine.py",)),
    Mutant("round-robin", "prefill stays on one slot instead of taking turns", ENGINE,
           "self._prefill_turn = slot.index + 1", "self._prefill_turn = slot.index", ("tests/test_engine.py",)),
    Mutant("top-p-mass", "top-p after top-k reads the mass before renormalising over the k", SAMPLING,
           "            probs = torch.softmax(vals, 0)\n", "            probs = torch.softmax(scores, 0)[ids]\n",
           ("tests/test_sampling.py",)),
    Mutant("fit-headroom", "the fit's verification compares with the capacity, not the capacity less headroom",
           FIT, "rows, slots, snapshots_on_device, weights,\n                                    available)",
           "rows, slots, snapshots_on_device, weights,\n                                    capacity)",
           ("tests/test_fit.py",)),
    Mutant("fit-fallback", "a planned chunk that misses when run is served anyway", FIT,
           "            chunk = chunk_floor\n", "            pass\n", ("tests/test_fit.py",)),
    Mutant("fit-oom", "out of memory while measuring the chunk counts as no workspace", FIT,
           "samples.append((position, max(room, 0) + 1))", "samples.append((position, 0))",
           ("tests/test_fit.py",)),
    Mutant("fit-early", "the fit answers one step below what fits", FIT,
           "return FitResult(plan.context, chunk,", "return FitResult(plan.context - step, chunk,",
           ("tests/test_fit.py",)),
    Mutant("error-type", "every error object says invalid_request_error", ERRORS,
           '"type": self.kind,', '"type": "invalid_request_error",', tuple(SERVER_TESTS)),
    Mutant("error-code", "error objects carry no code", ERRORS, '"code": self.status,', '"code": None,',
           tuple(SERVER_TESTS)),
    Mutant("error-param", "error objects name no field", ERRORS, '"param": self.param,', '"param": None,',
           tuple(SERVER_TESTS)),
    Mutant("timeout-ignored", "server.request_timeout is never enforced", RUNNER,
           "remaining = None if timeout is None else timeout - (time.monotonic() - started)", "remaining = None",
           ("tests/test_reliability.py",)),
    Mutant("disconnect-ignored", "a client that goes away does not cancel its handler", SERVE,
           "handler_cancellation=True", "handler_cancellation=False", ("tests/test_reliability.py",)),
    Mutant("store-refuses", "the prefix store refuses every insert", STORE,
           "if self.handles.contains_key(&handle) {", "if true || self.handles.contains_key(&handle) {",
           ("tests/test_core_prefix_store.py", "tests/test_prefix_cache.py")),
    Mutant("store-shortest", "a prompt restores the shortest stored prefix, not the longest", RADIX,
           "            if self.node(id).entry.is_some() {\n",
           "            if self.node(id).entry.is_some() && best.is_none() {\n",
           ("tests/test_core_prefix_store.py", "tests/test_prefix_cache.py")),
]


def rebuild() -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)], check=True,
                   cwd=ROOT, stdout=subprocess.DEVNULL)


def run_tests(tests: tuple[str, ...], timeout: float) -> tuple[bool, list[str]]:
    """Whether the tests passed, and the ids of those that failed."""
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *tests],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, ["(timed out)"]
    failed = [line.split()[1] for line in done.stdout.splitlines() if line.startswith(("FAILED tests/",
                                                                                        "ERROR tests/"))]
    return done.returncode == 0, failed


def check(mutant: Mutant, timeout: float) -> dict:
    path = ROOT / mutant.file
    original = path.read_text()
    if original.count(mutant.old) != 1:
        return {"name": mutant.name, "caught": None,
                "by": [f"the planted text occurs {original.count(mutant.old)} times in {mutant.file}"]}
    rust = mutant.file.endswith(".rs")
    started = time.monotonic()
    try:
        path.write_text(original.replace(mutant.old, mutant.new))
        if rust:
            rebuild()
        passed, failed = run_tests(mutant.tests, timeout)
    finally:
        path.write_text(original)
        if rust:
            rebuild()
    return {"name": mutant.name, "caught": not passed, "by": failed, "seconds": round(time.monotonic() - started)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run the mutants whose name contains this")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for one mutant's tests")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.only in m.name]
    tests = tuple(sorted({t for m in chosen for t in m.tests}))
    passed, failed = run_tests(tests, args.timeout)
    if not passed:
        print(f"the unmutated code fails its tests ({', '.join(failed)}): fix that first", file=sys.stderr)
        return 2
    print("| mutant | planted bug | caught | failing tests |\n|---|---|---|---|")
    survivors = 0
    for mutant in chosen:
        result = check(mutant, args.timeout)
        survivors += result["caught"] is not True
        caught = {True: f"yes ({result.get('seconds')} s)", False: "**no**", None: "**not planted**"}[result["caught"]]
        by = ", ".join(t.split("::")[-1] for t in result["by"][:4]) + (" ..." if len(result["by"]) > 4 else "")
        print(f"| {mutant.name} | {mutant.what} | {caught} | {by} |", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())

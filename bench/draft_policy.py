"""What the engine's choice of drafts (engine/draft_length.py) gives on a measured table of step costs, against
3 drafts every step, for drafts each taken with a given probability: computed, not run.

    python bench/draft_policy.py docs/results/mtp_full24_ud_q4_k_xl_costs160_h100_2026-12-06_831ac2a.json \
        [--accuracies 0.1,0.5,0.72,0.9] [--steps 3000]

The table is one that `bench/mtp_speed.py --choices adaptive` recorded (`step_costs_ms`: a step's milliseconds by
the positions it verifies a slot and its busy slots, as SpeculativeRunner.measure timed them when the engine
started), with the plain decode step it ran beside (`plain_ms_per_step`). Every slot stays busy for --steps steps;
each draft is taken with the accuracy's probability until the first that is not (seeded). The policy is the
engine's own DraftLength: its estimates, their recovery and its choice. Results that hold `step_extra_ms` (what the
engine's steps took beyond the table on the host's clock, by step length) price that in as well; older ones leave
out the host's work around a step. Requests ending and starting are left out.
"""

from __future__ import annotations

import argparse
import json
import random

from qwen4exp.engine.draft_length import DraftLength, StepCosts


def tokens_per_second(costs: StepCosts, slots: int, accuracy: float, steps: int, adaptive: bool) -> float:
    length, luck = DraftLength(most=3, adaptive=adaptive, costs=costs), random.Random(0)
    estimates = [length.fresh() for _ in range(slots)]
    tokens, seconds = 0, 0.0
    for _ in range(steps):
        drafts = length.choose_step({i: (estimates[i].rate, length.most) for i in range(slots)})
        seconds += costs.step(1 + max(drafts.values()), sum(1 + k for k in drafts.values()))
        for i, k in drafts.items():
            taken = 0
            while taken < k and luck.random() < accuracy:
                taken += 1
            tokens += 1 + taken
            length.learn(estimates[i], k, taken)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a bench/mtp_speed.py results file with --choices adaptive runs")
    parser.add_argument("--accuracies", default="0.1,0.5,0.72,0.9")
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    results = json.load(open(args.results))
    for slots, entry in results["slots"].items():
        run = next((r for r in entry.values() if r and r.get("step_costs_ms")), None)
        if run is None:
            continue
        costs = StepCosts.from_table(run["step_costs_ms"], run.get("step_extra_ms"))
        plain = int(slots) / (run["plain_ms_per_step"] / 1e3)
        for accuracy in (float(a) for a in args.accuracies.split(",")):
            fixed = tokens_per_second(costs, int(slots), accuracy, args.steps, adaptive=False)
            chosen = tokens_per_second(costs, int(slots), accuracy, args.steps, adaptive=True)
            print(f"{slots} slots, drafts right at {accuracy}: 3 drafts a step {fixed / plain:.3f}x plain, "
                  f"the engine's choice {chosen / plain:.3f}x ({plain:.0f} tok/s plain)")


if __name__ == "__main__":
    main()

"""Park and unpark a running daemon at each park level: how long each takes, what stays where, and whether the
model answers the same after it.

    python bench/park_levels.py --url http://127.0.0.1:8077 [--admin-key KEY] --out park.json

One greedy /generate (16 tokens, its token ids kept) before; then /park {"level": "release"} and /unpark, and twice
/park {"level": "offload"} and /unpark, each followed by the same request: out, each park's and unpark's answer
(seconds, bytes freed, host bytes kept, device bytes still in use, where the weights came from), the wall time
the client saw, and whether the token ids equal the first answer's.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request


def post(url: str, path: str, headers: dict, body: dict | None = None) -> tuple[dict, float]:
    started = time.perf_counter()
    request = urllib.request.Request(url + path, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=900) as answer:
        return json.loads(answer.read()), round(time.perf_counter() - started, 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8077")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--admin-key", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    url = args.url.rstrip("/")
    api = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    admin = {"Authorization": f"Bearer {args.admin_key or args.api_key}"} if args.admin_key or args.api_key else {}

    def answer() -> list[int]:
        out, _ = post(url, "/generate", api, {"prompt": "In the beginning the river ran north past the old house",
                                               "max_tokens": 16, "temperature": 0})
        return out["token_ids"]

    first = answer()
    runs = []
    for level in ("release", "offload", "offload"):
        parked, park_s = post(url, "/park", admin, {"mode": "wait", "level": level})
        unparked, unpark_s = post(url, "/unpark", admin)
        runs.append({"level": level, "park": parked, "park_wall_s": park_s, "unpark": unparked,
                     "unpark_wall_s": unpark_s, "same_token_ids": answer() == first})
        print(json.dumps(runs[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"url": url, "date": time.strftime("%Y-%m-%d"), "first_token_ids": first, "runs": runs}, f,
                  indent=1)


if __name__ == "__main__":
    main()

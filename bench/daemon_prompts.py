"""Cold prompts through a running daemon: each length's time to first token, as a client sees it, over repeats.

    python bench/daemon_prompts.py --url http://127.0.0.1:8077 --lengths 16384,250000 --repeats 3 --out prompts.json

Each prompt is new (random token ids, a different seed each time, so no prefix snapshot serves it) and sent as
`prompt_ids` to /generate with `"stream": true` and one new token. Out, per length: the client's time to first
token per repeat, their spread ((max - min) / min), and the daemon's own queue and prefill times of each request
(its final event's `usage`).
"""

from __future__ import annotations

import argparse
import json
import random
import time
import urllib.request


def one(url: str, headers: dict, ids: list[int]) -> dict:
    body = json.dumps({"prompt_ids": ids, "max_tokens": 1, "stream": True}).encode()
    started = time.perf_counter()
    request = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json",
                                                                            **headers})
    first, last = None, b""
    with urllib.request.urlopen(request, timeout=600) as answer:
        for line in answer:
            if line.startswith(b"data:"):
                first = first if first is not None else time.perf_counter() - started
                last = line
    final = json.loads(last[5:])
    return {"ttft_s": round(first, 4), "usage": final.get("usage")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8077")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--lengths", default="16384,250000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=4000, help="ids are drawn below this")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/")
    results = []
    for length in (int(n) for n in args.lengths.split(",")):
        runs = []
        for repeat in range(args.repeats):
            rng = random.Random(length * 1000 + repeat)
            runs.append(one(url, headers, [rng.randrange(args.vocab) for _ in range(length)]))
        ttfts = [r["ttft_s"] for r in runs]
        results.append({"tokens": length, "runs": runs, "ttft_s": ttfts,
                        "spread": round((max(ttfts) - min(ttfts)) / min(ttfts), 3)})
        print(json.dumps(results[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"url": url, "date": time.strftime("%Y-%m-%d"), "prompts": results}, f, indent=1)


if __name__ == "__main__":
    main()

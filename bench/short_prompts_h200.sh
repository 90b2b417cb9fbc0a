#!/usr/bin/env bash
# The short-prompt and chat-traffic measurements of docs/PERFORMANCE.md ("Short prompts and chat traffic"), in one
# run on a GPU host, so that one device lease takes them all:
#   1. bench/speed.py: decode, prefill and cold prompts of 128..262144 tokens split into their parts;
#   2. the 8-layer bench checkpoint written to CHECKPOINT (kept if it is there), served by the h200 profile,
#      once with decode_beside_prompts off and once on: the chat load (bench/load.py --mix chat) and cold prompts
#      through the daemon (bench/daemon_prompts.py) each time, keeping its /props and its /metrics after the load
#      (qwen4exp_prompt_chunks_total / qwen4exp_prompt_forwards_total: how many prompts a forward batched).
#
# Usage: bench/short_prompts_h200.sh OUT_DIR [CHECKPOINT]      (CHECKPOINT default /tmp/bench8; a directory or a
#        .gguf file: the 8-layer checkpoint is written there only when nothing is)
# Knobs: LOAD_SECONDS=30 (each load level), LEVELS=1,4,16,64, SKIP_SPEED=1, BESIDE="false true" (the daemon runs),
# BATCH=false (the daemon's batch_prompts in every run; true adds _batch to the file names), PORT=8077,
# SKIP_PROMPTS=1 (no cold prompts through the daemon), PROMPTS=16384,250000 (their lengths), REPEATS=3 (of each),
# READY_SECONDS=300 (the daemon's start, model load and fit included), PROFILE=h200. Other QWEN4EXP_*
# variables (QWEN4EXP_SLOTS, QWEN4EXP_CHUNK) reach the daemon as they are. With the
# defaults it takes about 12 minutes on the H200 (the speed bench ~3, writing the checkpoint ~1, each daemon run
# ~4); split it over calls with SKIP_SPEED=1 and BESIDE=false / BESIDE=true.
set -uo pipefail

out=${1:?usage: bench/short_prompts_h200.sh OUT_DIR [CHECKPOINT]}
checkpoint=${2:-/tmp/bench8}
port=${PORT:-8077}
url=http://127.0.0.1:$port
mkdir -p "$out"

if [ -z "${SKIP_SPEED:-}" ]; then
    python3 bench/speed.py --random-weights --preset bench --layers 8 --dtype bfloat16 --device cuda --slots 4 \
        --chunk 2048 --busy 1,4 --prefill 512,4096,16384 --decode-steps 32 \
        --ttft-prompts 128,512,2048,16384,65536,262144 --out "$out/speed.json" > "$out/speed.log" 2>&1
    echo "speed: rc $?"
fi

if [ ! -e "$checkpoint" ]; then
    qwen4exp init-checkpoint --preset bench --layers 8 --out "$checkpoint" --device cuda > "$out/init.log" 2>&1 \
        || { echo "init-checkpoint failed: $out/init.log"; exit 1; }
fi

batch=${BATCH:-false}
for beside in ${BESIDE:-false true}; do
    tag=beside_$beside$([ "$batch" = true ] && echo _batch)
    QWEN4EXP_MODEL=$checkpoint QWEN4EXP_DECODE_BESIDE_PROMPTS=$beside QWEN4EXP_BATCH_PROMPTS=$batch \
        qwen4exp serve --profile "${PROFILE:-h200}" --port "$port" > "$out/serve_$tag.log" 2>&1 &
    server=$!
    started=$(date +%s)
    until [ "$(curl -s -o /dev/null -w '%{http_code}' "$url/health")" = 200 ]; do
        kill -0 $server 2>/dev/null || { echo "the daemon exited: $out/serve_$tag.log"; exit 1; }
        [ $(( $(date +%s) - started )) -gt "${READY_SECONDS:-300}" ] && { echo "not ready in time"; kill $server; exit 1; }
        sleep 1
    done
    echo "$tag: ready after $(( $(date +%s) - started )) s"
    curl -s "$url/props" > "$out/props_$tag.json"
    python3 bench/load.py --url "$url" --mix chat --seconds "${LOAD_SECONDS:-30}" --levels "${LEVELS:-1,4,16,64}" \
        --out "$out/load_chat_$tag.json" > "$out/load_$tag.log" 2>&1
    echo "$tag: load rc $?"
    curl -s "$url/metrics" > "$out/metrics_$tag.txt"
    if [ -z "${SKIP_PROMPTS:-}" ]; then
        python3 bench/daemon_prompts.py --url "$url" --lengths "${PROMPTS:-16384,250000}" --repeats "${REPEATS:-3}" \
            --out "$out/daemon_prompts_$tag.json" > "$out/daemon_prompts_$tag.log" 2>&1
        echo "$tag: prompts rc $?"
    fi
    kill $server
    wait $server
done

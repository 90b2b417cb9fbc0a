#!/usr/bin/env bash
# Build llama.cpp's llama-bench (CUDA, sm_90 / H200) from a trimmed source tree
# made by bench/llama_cpp_fetch.sh, and run it on a GGUF for the peer comparison.
# Works offline: needs only cmake, ninja, a C/C++ compiler and nvcc on the machine.
#
# Usage: bench/llama_cpp_bench.sh SRC_DIR GGUF OUT_DIR [extra llama-bench args]
#
# Writes into OUT_DIR:
#   llama_build.log        configure + build output (or a note that the build was reused)
#   llama_bench_help.txt   `llama-bench --help`
#   nvidia_smi.txt         `nvidia-smi`
#   llama_bench.json       `-o json` results (stdout of the run)
#   llama_bench.md         markdown table of the same run (`-oe md`, llama-bench's stderr)
#   llama_bench_cmd.txt    the exact llama-bench command line
#
# Environment knobs:
#   JOBS=15            build parallelism
#   BUILD_DIR=...      build directory (default SRC_DIR/build); reused when bin/llama-bench exists.
#                      If SRC_DIR is re-copied on every remote call, put it outside, e.g. .peer/llama-build
#   CUDA_ARCH=90       CMAKE_CUDA_ARCHITECTURES
#   FA=1               flash attention (`-fa on|off|auto`, 1/0 accepted); FA= (empty) leaves it to llama-bench's default (auto)
#   BUILD_ONLY=1       stop after the build (e.g. to split a long build over several calls; ninja resumes)
#   SEPARATE_MD=1      do a second, separate `-o md` run instead of `-oe md` on the same run
set -uo pipefail

die() {
    echo "llama_cpp_bench: error: $*" >&2
    if [ -n "${BUILD_LOG:-}" ] && [ -d "$(dirname "$BUILD_LOG")" ]; then echo "llama_cpp_bench: error: $*" >> "$BUILD_LOG"; fi
    exit 1
}

[ $# -ge 3 ] || { sed -n 2,23p "$0" >&2; exit 2; }
SRC_DIR="$(cd "$1" 2>/dev/null && pwd)" || die "SRC_DIR '$1' not found"
GGUF="$2"
OUT_DIR="$3"
shift 3
EXTRA=("$@")

JOBS="${JOBS:-15}"
CUDA_ARCH="${CUDA_ARCH:-90}"
FA="${FA-1}"
BUILD_DIR="${BUILD_DIR:-$SRC_DIR/build}"
BENCH="$BUILD_DIR/bin/llama-bench"

mkdir -p "$OUT_DIR" || die "cannot create OUT_DIR '$OUT_DIR'"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
BUILD_LOG="$OUT_DIR/llama_build.log"

[ -f "$SRC_DIR/CMakeLists.txt" ] || die "$SRC_DIR has no CMakeLists.txt (run bench/llama_cpp_fetch.sh first)"
# fail before a long build when the model path is wrong
[ "${BUILD_ONLY:-0}" = 1 ] || [ -f "$GGUF" ] || die "GGUF '$GGUF' not found"

# nvcc is often installed but not on PATH
if ! command -v nvcc >/dev/null 2>&1; then
    for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
        if [ -x "$d/nvcc" ]; then export PATH="$d:$PATH"; break; fi
    done
fi

build() {
    command -v cmake >/dev/null 2>&1 || die "cmake not found"
    command -v ninja >/dev/null 2>&1 || die "ninja not found"
    command -v nvcc  >/dev/null 2>&1 || die "nvcc not found (PATH or /usr/local/cuda/bin)"

    local version="unknown"
    [ -f "$SRC_DIR/PEER_VERSION.txt" ] && version="$(head -n1 "$SRC_DIR/PEER_VERSION.txt")"
    {
        echo "# llama-bench build: $(date -u +%FT%TZ)"
        echo "# source: $SRC_DIR ($version)"
        echo "# build dir: $BUILD_DIR, jobs: $JOBS, CUDA arch: $CUDA_ARCH"
        cmake --version | head -n1
        echo "ninja $(ninja --version)"
        nvcc --version | tail -n2
    } > "$BUILD_LOG" 2>&1

    # LLAMA_BUILD_COMMIT is pinned so the build info does not pick up the git
    # commit of an enclosing repository (the trimmed tree has no .git of its own).
    local cfg=(
        -S "$SRC_DIR" -B "$BUILD_DIR" -G Ninja
        -DCMAKE_BUILD_TYPE=Release
        -DGGML_CUDA=ON
        -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH"
        -DGGML_NATIVE=OFF
        -DGGML_CCACHE=OFF
        -DGGML_CUDA_NCCL=OFF
        -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_EXAMPLES=OFF
        -DLLAMA_BUILD_SERVER=OFF
        -DLLAMA_BUILD_APP=OFF
        -DLLAMA_CURL=OFF
        -DLLAMA_OPENSSL=OFF
        -DLLAMA_BUILD_COMMIT=llama-cpp-python-0.3.36
        -DLLAMA_BUILD_NUMBER=0
    )
    echo "+ cmake ${cfg[*]}" >> "$BUILD_LOG"
    if ! cmake "${cfg[@]}" >> "$BUILD_LOG" 2>&1; then
        tail -n 40 "$BUILD_LOG" >&2
        die "cmake configure failed; see $BUILD_LOG"
    fi
    echo "+ cmake --build $BUILD_DIR --target llama-bench -j $JOBS" >> "$BUILD_LOG"
    local t0=$SECONDS
    if ! cmake --build "$BUILD_DIR" --target llama-bench -j "$JOBS" >> "$BUILD_LOG" 2>&1; then
        grep -n -m 20 -E 'error|FAILED' "$BUILD_LOG" >&2
        tail -n 40 "$BUILD_LOG" >&2
        die "build of llama-bench failed; see $BUILD_LOG"
    fi
    echo "# build took $((SECONDS - t0)) s" >> "$BUILD_LOG"
    [ -x "$BENCH" ] || die "build finished but $BENCH is missing; see $BUILD_LOG"
}

if [ -x "$BENCH" ]; then
    echo "# reusing existing build $BENCH ($(date -u +%FT%TZ)); remove it to rebuild" > "$BUILD_LOG"
else
    echo "building llama-bench into $BUILD_DIR (log: $BUILD_LOG) ..." >&2
    build
fi
echo "llama-bench: $BENCH" >&2

"$BENCH" --help > "$OUT_DIR/llama_bench_help.txt" 2>&1 || true
"$BENCH" --version >> "$OUT_DIR/llama_bench_help.txt" 2>&1 || true
nvidia-smi > "$OUT_DIR/nvidia_smi.txt" 2>&1 || echo "nvidia-smi failed" >&2

if [ "${BUILD_ONLY:-0}" = 1 ]; then
    echo "BUILD_ONLY=1: not running the benchmark" >&2
    exit 0
fi

args=(-m "$GGUF" -ngl 99 -p 512,4096 -n 128 -r 3)
# this llama.cpp spells flash attention `-fa, --flash-attn <on|off|auto>` (1/0 accepted; default auto)
[ -n "$FA" ] && args+=(-fa "$FA")
args+=("${EXTRA[@]}")

echo "$BENCH ${args[*]} -o json -oe md" > "$OUT_DIR/llama_bench_cmd.txt"
echo "+ $(cat "$OUT_DIR/llama_bench_cmd.txt")" >&2
rc=0
if [ "${SEPARATE_MD:-0}" = 1 ]; then
    "$BENCH" "${args[@]}" -o json > "$OUT_DIR/llama_bench.json" 2> "$OUT_DIR/llama_bench.stderr.log" || rc=$?
    if [ $rc -eq 0 ]; then
        "$BENCH" "${args[@]}" -o md > "$OUT_DIR/llama_bench.md" 2>> "$OUT_DIR/llama_bench.stderr.log" || rc=$?
    fi
    [ $rc -eq 0 ] || { tail -n 40 "$OUT_DIR/llama_bench.stderr.log" >&2; die "llama-bench exited with $rc"; }
else
    # one run: JSON on stdout, the same results as a markdown table on stderr
    "$BENCH" "${args[@]}" -o json -oe md > "$OUT_DIR/llama_bench.json" 2> "$OUT_DIR/llama_bench.md" || rc=$?
    [ $rc -eq 0 ] || { tail -n 40 "$OUT_DIR/llama_bench.md" >&2; die "llama-bench exited with $rc (its stderr is in $OUT_DIR/llama_bench.md)"; }
fi
cat "$OUT_DIR/llama_bench.md"
echo "results: $OUT_DIR/llama_bench.json $OUT_DIR/llama_bench.md" >&2

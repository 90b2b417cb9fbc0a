#!/usr/bin/env bash
# Fetch a trimmed llama.cpp source tree that is just enough to configure and
# build the `llama-bench` target with -DGGML_CUDA=ON (CPU + CUDA backends).
#
# Version: the llama.cpp vendored by llama-cpp-python 0.3.36 (sdist from PyPI,
# vendor/llama.cpp). This is reference build input for the peer comparison
# (bench/llama_cpp_bench.sh), NOT shipped code: it is fetched into .peer/
# (git-ignored locally) and carried to the offline GPU machine.
#
# Usage: bench/llama_cpp_fetch.sh [DEST]   (default DEST: .peer/llama.cpp)
#
# The trimmed tree is meant to be configured with
#   -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
#   -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF (LLAMA_CURL=OFF is accepted too)
# and only GGML_CPU / GGML_CUDA backends (tests/, examples/, pocs/, app/,
# tools/{server,cli,ui,rpc,tuning} and every other ggml-* backend are left out;
# CMake only descends into those when the matching switch is ON).
set -euo pipefail

VERSION=0.3.36
URL="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-${VERSION}.tar.gz"
MAX_MIB=28

DEST="${1:-.peer/llama.cpp}"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "fetching llama-cpp-python ${VERSION} sdist ..." >&2
if ! (cd "$TMP" && curl -fsSLO "$URL"); then
    echo "curl failed, trying pip download ..." >&2
    python3 -m pip download -q --no-deps --no-binary :all: -d "$TMP" "llama-cpp-python==${VERSION}"
fi
tar -xzf "$TMP"/llama_cpp_python-"${VERSION}".tar.gz -C "$TMP"
SRC="$TMP/llama_cpp_python-${VERSION}/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || { echo "error: $SRC/CMakeLists.txt not found" >&2; exit 1; }

rm -rf "$DEST"
mkdir -p "$DEST"

# copy SRC-relative paths into DEST, keeping the layout
copy() {
    local p
    for p in "$@"; do
        [ -e "$SRC/$p" ] || { echo "error: missing $p in source" >&2; exit 1; }
        mkdir -p "$DEST/$(dirname "$p")"
        cp -a "$SRC/$p" "$DEST/$p"
    done
}

# top level: root CMakeLists, cmake modules, licenses (license.cmake embeds LICENSE)
copy CMakeLists.txt LICENSE cmake licenses

# libllama, its public headers, llama-common, vendored header libs used by common/mtmd
copy include src common vendor

# ggml: everything except backends other than CPU and CUDA.
# (ggml-hip / ggml-musa only reuse ggml-cuda sources when GGML_HIP / GGML_MUSA are ON;
#  ggml/src/CMakeLists.txt only add_subdirectory()s a backend whose GGML_<NAME> is ON.)
copy ggml/CMakeLists.txt ggml/cmake ggml/include
for f in "$SRC"/ggml/src/*; do
    b="$(basename "$f")"
    case "$b" in
        ggml-cpu|ggml-cuda) copy "ggml/src/$b" ;;
        ggml-*) [ -d "$f" ] && continue; copy "ggml/src/$b" ;;   # files like ggml-alloc.c, ggml-backend.cpp
        *) copy "ggml/src/$b" ;;
    esac
done

# tools/: tools/CMakeLists.txt add_subdirectory()s these unconditionally when
# LLAMA_BUILD_TOOLS is ON (server/cli/ui only with LLAMA_BUILD_SERVER, rpc with
# GGML_RPC, tuning with GGML_METAL), so they must exist for configure to pass;
# only llama-bench is actually built.
copy tools/CMakeLists.txt
for t in batched-bench gguf-split imatrix llama-bench completion perplexity quantize \
         tokenize tts mtmd cvector-generator export-lora fit-params results; do
    copy "tools/$t"
done
# media / test data of mtmd is not needed to configure or build
rm -rf "$DEST"/tools/mtmd/test-*.jpeg "$DEST"/tools/mtmd/test-*.mp3 "$DEST"/tools/mtmd/test-*.mp4

# drop documentation bulk that no CMake file reads
find "$DEST" -type f \( -name '*.md' -o -name '*.png' -o -name '*.jpg' -o -name '*.gif' \) -delete

printf 'llama-cpp-python %s vendored llama.cpp (trimmed by bench/llama_cpp_fetch.sh)\n' "$VERSION" \
    > "$DEST/PEER_VERSION.txt"

size_kib="$(du -sk "$DEST" | cut -f1)"
du -sh "$DEST"
if [ "$size_kib" -gt $((MAX_MIB * 1024)) ]; then
    echo "error: $DEST is ${size_kib} KiB, over ${MAX_MIB} MiB" >&2
    exit 1
fi
echo "ok: $DEST ($((size_kib / 1024)) MiB)" >&2

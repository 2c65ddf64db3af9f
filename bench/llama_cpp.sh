#!/usr/bin/env bash
# llama.cpp, the CPU peer of bench/sample_bench.py and bench/serve_bench.py, built from source: the source
# that the `llama-cpp-python` sdist on PyPI vendors (llama.cpp itself, its convert_hf_to_gguf.py and gguf-py),
# compiled with cmake for this CPU (GGML_NATIVE), no network code. Into ~/.cache/gpt-bench/llama.cpp
# (or $XDG_CACHE_HOME's), outside the repository:
#
#   bash bench/llama_cpp.sh     # prints two lines: the build (bin/llama-batched-bench, bin/llama-server,
#                               # bin/llama-lookup, bin/llama-speculative, bin/llama-quantize)
#                               # and the source (convert_hf_to_gguf.py, gguf-py)
#
# The benches convert their own HF directory to GGUF with the vendored converter (gpt2 architecture: it
# needs n_ctx in config.json; a Llama's imports sentencepiece, `pip install sentencepiece`, before it reads
# tokenizer.json) and quantize it to q8_0 there (`--outtype q8_0`).
set -euo pipefail
cd "$(dirname "$0")"
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
ROOT=${XDG_CACHE_HOME:-$HOME/.cache}/gpt-bench/llama.cpp
SOURCE=$ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp
BUILD=$ROOT/build-$VERSION
mkdir -p "$ROOT"
if [ ! -d "$SOURCE" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: -d "$ROOT" "llama-cpp-python==$VERSION" >&2
  tar -xzf "$ROOT/llama_cpp_python-$VERSION.tar.gz" -C "$ROOT"
fi
TARGETS="llama-batched-bench llama-server llama-lookup llama-speculative llama-quantize"
if ! (for target in $TARGETS; do [ -x "$BUILD/bin/$target" ] || exit 1; done); then
  cmake -S "$SOURCE" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DBUILD_SHARED_LIBS=OFF >&2
  cmake --build "$BUILD" -j "$(nproc)" --target $TARGETS >&2
fi
echo "$BUILD"
echo "$SOURCE"

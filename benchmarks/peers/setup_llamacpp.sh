#!/usr/bin/env bash
# llama.cpp's llama-bench, llama-server and llama-batched-bench built from the source vendored in
# PyPI's llama-cpp-python sdist (the registries are all these machines reach), with the native
# CPU flags of the machine at hand; binaries in benchmarks/peers/.llamacpp/bin. ~10 minutes on
# 2 cores: a benchmark setup, not part of CI.
set -euo pipefail
cd "$(dirname "$0")"
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DIR=.llamacpp
mkdir -p "$DIR"
if [ ! -d "$DIR/src" ]; then
    PIP_DISABLE_PIP_VERSION_CHECK=1 python3 -m pip download -q --no-binary :all: --no-deps \
        "llama-cpp-python==$VERSION" -d "$DIR/dl"
    mkdir -p "$DIR/src"
    tar -xzf "$DIR"/dl/llama_cpp_python-*.tar.gz -C "$DIR/src" --strip-components=1
fi
SRC="$DIR/src/vendor/llama.cpp"
# llama.cpp bug #20824 (fix proposed in its PR #26954): ggml's AMX matmul builds its tile configuration
# on the stack, and GCC drops the stores before LDTILECFG, so the first multi-token batch on an AMX CPU
# faults (llama-server dies in its warm-up; llama-bench tg, one token at a time, runs). A compiler
# barrier that takes the configuration's address keeps the stores. Applied once; a no-op elsewhere.
MMQ="$SRC/ggml/src/ggml-cpu/amx/mmq.cpp"
if [ -f "$MMQ" ] && ! grep -q 'conveyor: keep the tile config' "$MMQ"; then
    sed -i 's|^\( *\)_tile_loadconfig(&tc);|\1asm volatile("" : : "r"(\&tc) : "memory");  // conveyor: keep the tile config\n\1_tile_loadconfig(\&tc);|' "$MMQ"
fi
cmake -S "$SRC" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF > "$DIR/cmake.log"
cmake --build "$DIR/build" -j "$(nproc)" --target llama-bench llama-server llama-batched-bench > "$DIR/build.log"
mkdir -p "$DIR/bin"
for b in llama-bench llama-server llama-batched-bench; do cp "$DIR/build/bin/$b" "$DIR/bin/"; done
"$DIR/bin/llama-bench" --help > /dev/null && echo "llama.cpp from llama-cpp-python $VERSION: $DIR/bin"

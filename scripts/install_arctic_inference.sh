#!/usr/bin/env bash
# Optional: vLLM's `suffix` speculation needs the arctic-inference package, which
# PyPI ships only as source. Its build wants torch in the build environment, and
# pip's isolated build would pull the multi-GB CUDA torch, so this builds the wheel
# in a throw-away venv holding the CPU torch and installs it (no deps) into the
# active environment. One to four minutes on 2 cores.
#   . .venv/bin/activate && bash scripts/install_arctic_inference.sh
# The package's vLLM plugin stays off unless ARCTIC_INFERENCE_ENABLED=1; only its
# suffix-tree cache (arctic_inference.suffix_decoding) is used.
set -euo pipefail
PY=${PYTHON:-python}
VERSION=${ARCTIC_INFERENCE_VERSION:-0.3.0}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install --quiet --upgrade pip
"$WORK/venv/bin/pip" install --quiet "torch==2.13.0" setuptools wheel ninja cmake "nanobind==2.9.2" "protobuf==5.29.6" grpcio-tools
"$WORK/venv/bin/pip" download --quiet --no-deps --no-build-isolation --no-binary arctic-inference -d "$WORK/src" "arctic-inference==$VERSION"
# The build runs in the throw-away venv: CMake's FindPython follows VIRTUAL_ENV, so point
# it there (else it finds the caller's venv, which has no nanobind, and fails).
VIRTUAL_ENV="$WORK/venv" PATH="$WORK/venv/bin:$PATH" \
CMAKE_PREFIX_PATH="$("$WORK/venv/bin/python" -m nanobind --cmake_dir)" \
ARCTIC_MINIMAL_BUILD=1 "$WORK/venv/bin/pip" wheel --quiet --no-build-isolation --no-deps -w "$WORK/wheel" "$WORK"/src/arctic_inference-*.tar.gz
"$PY" -m pip install --quiet --no-deps "$WORK"/wheel/arctic_inference-*.whl
"$PY" -c "from vllm.utils.import_utils import has_arctic_inference; from arctic_inference.suffix_decoding import SuffixDecodingCache; assert has_arctic_inference(); print('arctic-inference OK: vLLM method suffix is available')"

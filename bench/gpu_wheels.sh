#!/usr/bin/env bash
# Download, here, the wheels of the packages the GPU machine's image lacks (it has JAX, flax, optax, orbax,
# torch, transformers, tiktoken, pytest, ...; not the CLIs' and the server's own), into .whl/ (ignored by
# git). `bench/gpu.sh` installs them there. Python 3.12, manylinux x86-64, as on that machine.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
# Each name and the names it needs that the image lacks (found with `pip show` there).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  tyro docstring-parser typeguard shtab tensorboardX zstandard fastapi starlette pydantic pydantic-core \
  annotated-types typing-inspection typing-extensions opentelemetry-api importlib-metadata uvicorn openai distro \
  jiter sniffio httpx2 httpcore2 truststore
du -sh .whl

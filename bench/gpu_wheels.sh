#!/usr/bin/env bash
# The wheels a device call carries in .whl/ (the device machine has no package index):
# gguf for the kernel tests, and what `cadence serve` needs beyond the device image's
# packages (FastAPI and its pydantic, uvicorn, pyzmq). Run here once, then carry ".whl";
# bench/gpu_session.sh installs them. Python 3.12 is the device image's.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl \
    gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4 \
    annotated-types==0.7.0 typing-inspection==0.4.2 opentelemetry-api pyzmq==27.3.0
du -sh .whl

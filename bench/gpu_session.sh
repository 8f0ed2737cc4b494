#!/usr/bin/env bash
# What a session lent a GPU runs first: one stage per device call (each fits the 10-minute
# limit), output under $OUT. Record what it prints in bench/RESULTS.md with the device name.
#
#   bash bench/gpu_session.sh tests     # the test files that hold CUDA tests (CPU CI skips those)
#   bash bench/gpu_session.sh kernels   # bench/gpu_kernels.py quant + attention sections, quick sizes
#   bash bench/gpu_session.sh decode    # bench/gpu_decode.py at Llama-8B shapes, graphs only
#   bash bench/gpu_session.sh invariant # what --batch-invariant costs at batch 1/16/64 (gpu_decode.py)
#   bash bench/gpu_session.sh serve     # `cadence serve`, 8B-shaped: batch 1-256, graphs/eager, bf16/int8/int4
#                                       # (arguments after the stage go to bench/gpu_serve.py)
#   bash bench/gpu_session.sh tune      # bench/tune_tiled.py: the tiled GEMMs' launches, against dense
#   bash bench/gpu_session.sh profile   # bench/step_profile.py: a decode step's device time against its wall
#                                       # time at batch 1/64/256 (arguments after the stage go to it)
#
# The device machine has torch and triton but no pip index: `bash bench/gpu_wheels.sh` here
# puts gguf and the server's packages in .whl/ (carry it), installed into /tmp/site, and
# this checkout is imported as `cadence` through a symlink in /tmp/pkg.
set -euo pipefail
stage="${1:?usage: gpu_session.sh tests|kernels|decode|invariant|serve|tune|profile}"
out="${OUT:-/tmp/gpu_session}"
mkdir -p "$out" /tmp/pkg
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
ln -sfn "$PWD" /tmp/pkg/cadence
export PYTHONPATH="/tmp/site:/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || echo "no nvidia-smi"; } | tee "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"

case "$stage" in
    tests)
        # -rs lists every skip: on a GPU none of these should say "needs CUDA". The kernel and
        # backend tests go along unfiltered: on a GPU their tensors sit on it (DEVICE in tests/support/helpers.py),
        # so their interpreter shapes then run through the compiled kernels. Triton compiles on
        # the host, so several pytest workers share the one GPU; a hung test fails after 120 s.
        # Both runs go ahead whatever the first one's result; the stage fails if either did. The
        # `-m gpu` tests of the rest go first: fewer and newer, so a call cut short still reports them.
        parallel=()
        python3 -c "import xdist, pytest_timeout" 2>/dev/null && parallel=(-n 8 --timeout 120)
        status=0
        python3 -m pytest -q -rs -p no:cacheprovider "${parallel[@]}" --continue-on-collection-errors -m gpu tests \
            --ignore-glob="tests/kernels/test_kernels_*.py" --ignore=tests/engine/test_triton_backend.py \
            --ignore=tests/kernels/test_fp8.py --ignore=tests/kernels/test_batch_invariant_cuda.py \
            2>&1 | tee "$out/tests.log" || status=1
        python3 -m pytest -q -rs -p no:cacheprovider "${parallel[@]}" --continue-on-collection-errors \
            tests/kernels/test_kernels_*.py tests/engine/test_triton_backend.py tests/kernels/test_fp8.py \
            tests/kernels/test_batch_invariant_cuda.py 2>&1 \
            | tee -a "$out/tests.log" || status=1
        exit "$status"
        ;;
    kernels)
        # M from 1 to 256 for the quantized GEMMs: the "never slower than dense" target's range.
        python3 bench/gpu_kernels.py --only ceilings quant attention --quick --m 1 2 3 4 8 16 64 256 \
            --budget-s "${KERNELS_BUDGET_S:-500}" --out "$out" 2>&1 \
            | tee "$out/kernels.log"
        ;;
    decode)
        python3 bench/gpu_decode.py --no-eager --quantize-lm-head --layers 32 --hidden 4096 --intermediate 14336 \
            2>&1 | tee "$out/decode.log"
        ;;
    invariant)
        # Its own stage: six engines of an 8B-shaped model do not fit beside the decode stage's
        # runs in one call. 1B-shaped first, so a call cut short still reports something.
        python3 bench/gpu_decode.py --batch-invariant --new-tokens 64 2>&1 | tee "$out/invariant.log"
        python3 bench/gpu_decode.py --batch-invariant --new-tokens 64 --layers 32 --hidden 4096 --intermediate 14336 \
            2>&1 | tee -a "$out/invariant.log"
        ;;
    serve)
        (cd bench && python3 gpu_serve.py "${@:2}") 2>&1 | tee "$out/serve.log"
        ;;
    profile)
        (cd bench && python3 step_profile.py "${@:2}") 2>&1 | tee "$out/profile.log"
        ;;
    tune)
        (cd bench && python3 tune_tiled.py --budget-s "${TUNE_BUDGET_S:-240}" --out "$out") 2>&1 | tee "$out/tune.log"
        ;;
    *)
        echo "unknown stage: $stage" >&2
        exit 2
        ;;
esac

"""The environment that caps every CPU library Cadence computes with to AVX2: torch's own
kernels, MKL, oneDNN, fbgemm and what numba (so LLVM) compiles for. On a CPU with AVX-512
it stands in for one without, for benchmarks (bench/vs_peers.py --avx2-only) and for the
tests that check what such a CPU computes. Clocks, caches and memory stay the host's: it
approximates a CPU without AVX-512, it does not measure one. Set it before the process
starts: the libraries read it once, when they load."""

from __future__ import annotations

# Haswell's features, without any AVX-512 one: numba's CPU name alone would leave LLVM
# the host's AVX-512 features.
AVX2_FEATURES = ",".join(
    "+" + f
    for f in "64bit avx avx2 bmi bmi2 cmov cx16 f16c fma fsgsbase lzcnt mmx movbe pclmul popcnt rdrnd "
    "sse sse2 sse3 sse4.1 sse4.2 ssse3 xsave xsaveopt".split()
)
AVX2_ONLY_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    "NUMBA_CPU_NAME": "haswell",
    "NUMBA_CPU_FEATURES": AVX2_FEATURES,
}

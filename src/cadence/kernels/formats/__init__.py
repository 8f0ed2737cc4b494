"""The formats the CPU and Triton kernels share, in plain torch: packed int8 / int4
weights, fp8 (e4m3) quantization, and quantized KV-cache rows."""

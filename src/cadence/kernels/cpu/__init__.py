"""CPU kernels: the numba GEMMs and paged decode attention, the half-precision and
quantized linears built on torch's oneDNN and fbgemm ops, and the names and rules by which
a quantized layer's kernel is chosen. Nothing here imports triton."""

"""Batch invariance: a request's greedy tokens do not depend on what else runs in its step.

The guarantee: every output row of every op a token passes through has the same bits
whether it runs alone, in any batch, in a decode step or in any chunking of its prompt.
A greedy decode can then never take another token because of its neighbours.

How it is kept: no op may choose its arithmetic (kernel, tile shape, split, and with them
the order of a sum) from the batch.

* On CUDA, under ``--batch-invariant`` (the engine's ``make_batch_invariant`` sets a
  model's flags; it costs the split-K and split-KV parallelism that fills a GPU at small
  batches, and cuBLAS's tuned kernels at large ones): dense linears and a dense tied head
  through ``triton_gemm.py`` (one tile for every M, no split-K, K summed in one order);
  the int8 / int4 / fp8 Triton GEMMs at its ``BLOCK_M`` with no split-K, never their
  GEMV, dequantize-then-cuBLAS path or ``_scaled_mm``; paged attention without split-KV,
  a decode on the same tiles as a prefill chunk. RMSNorm, rotary, SiLU-and-mul and the
  KV-cache write are one program per row already, and CUDA graphs pad a batch with rows
  of their own that no real row reads.
* On CPU, always: dense linears through ``cpu_linear.py`` (BLAS only at tile sizes
  measured on the machine to give every row the same bits), each quantized layer through
  one kernel of ``kernels/cpu/`` that sums a row in one order, attention shaped by
  ``sdpa.py`` (padded key and query lengths, additive masks) or the paged decode kernel
  (``kernels/cpu/paged_decode.py``, one task per row).

This package imports nothing, so importing it loads no triton.
"""

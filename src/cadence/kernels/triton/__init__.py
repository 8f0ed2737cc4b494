"""Triton kernels, each next to the plain-torch reference it must match.

They run on CUDA tensors, and on CPU tensors only under ``TRITON_INTERPRET=1`` (tests).
Every module here imports triton, so a CPU path imports none of them.
"""

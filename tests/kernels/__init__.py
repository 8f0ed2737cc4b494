"""Kernels (Triton and CPU) against their plain-torch references, and that every Triton
kernel compiles; the CPU kernel planner's choices."""

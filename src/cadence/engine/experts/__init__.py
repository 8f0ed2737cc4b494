"""Expert offloading for mixture-of-experts models: the routed experts of each MoE layer
live in host memory or on disk, and a fixed pool of slots in fast memory holds the ones
in use (docs/design/expert-offloading.md)."""

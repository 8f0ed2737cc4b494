"""Constrained decoding's engine side: grammar matchers per sequence, compiled off the
engine loop, and their token masks applied in the sampler (docs/ARCHITECTURE.md)."""

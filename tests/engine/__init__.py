"""The engine and its models against transformers on tiny random (or the default)
checkpoints: greedy tokens, logits, quantized and converted weights, expert offloading,
in-process disaggregation."""

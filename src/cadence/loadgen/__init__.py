"""`cadence loadgen`: a load generator for any OpenAI-compatible server.

Flags and result fields follow `vllm bench serve` where the meaning is the same. On top:
latencies timed from when each request was due, goodput, sweeps and a capacity search,
the server's own /metrics beside the client's figures, fault injection, and plots.
"""

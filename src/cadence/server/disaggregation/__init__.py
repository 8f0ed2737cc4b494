"""Prefill/decode disaggregation, the router's side: which engines a server drives
(topology), the request state machine over them (coordinator, placement), a router's
links to workers on other hosts (remote engines, worker links), and their command line.
The KV transports themselves live in engine/kv_transfer/."""

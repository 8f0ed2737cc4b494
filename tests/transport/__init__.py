"""What carries KV and requests between engines and routers: the TCP, shared-memory and
NIXL KV transports, the router-worker link, and engines as separate processes."""

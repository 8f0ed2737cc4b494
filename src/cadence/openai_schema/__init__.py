"""The OpenAI-compatible API's bodies, shared by the server and the client SDK.

`requests` holds what a client sends (validated at the server's edge), `responses` what
the server answers (built by the server, parsed by `cadence.client`). Only pydantic and
the standard library are imported here, never the server or the engine, so the SDK
installs and imports without torch, transformers, FastAPI or ZMQ.
"""

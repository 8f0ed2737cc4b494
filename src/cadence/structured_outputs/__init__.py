"""Constrained decoding's request side: what a request asks for, as a grammar, checked.

Pure Python plus llguidance (no torch), so the API process validates a request's schema
or grammar before it queues anything, and the engine compiles the same grammar text.
"""

"""Tokenizers as the engine and the API process both load them, without torch.

`loading` finds a model folder's Hugging Face tokenizer; `gguf_tokenizer` rebuilds one
from a GGUF file's metadata, which the GGUF converter writes beside the weights. Only
transformers, tokenizers and gguf are imported here, so the API process loads its
tokenizer without the engine.
"""

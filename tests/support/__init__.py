"""What the tests share: tiny random models and tokenizers, references, checks, server
harnesses, and the scripts tests start in processes of their own. Nothing here is a test."""

"""llguidance and xgrammar behind one interface, each called as a server would call it.

Both write the same int32 bitmask (one bit per vocabulary entry, rows of ceil(V / 32)
words), and both are set up for Cadence's JSON: no free whitespace, ", " and ": "
separators, properties in the schema's order.

- llguidance runs with Cadence's settings (its JSON options, `parser_limits`,
  `ll_tokenizer`): "compiling" is building the grammar text and a matcher from it; a
  request's matcher is a deep copy of that one. Its lexer is built lazily, during masks.
- xgrammar compiles a schema once into a CompiledGrammar (its cache off, so every compile
  is cold); a request's matcher is a GrammarMatcher over it. `xgrammar-dynamic` turns on
  its dynamic compilation, which moves the token-mask cache from compile time to first use.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from numpy.typing import NDArray

ENGINES = ("llguidance", "xgrammar", "xgrammar-dynamic")
XGRAMMAR_INSTALL = "pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi"
SEPARATORS = (", ", ": ")
# Cadence's JSON options (cadence.structured_outputs.grammar.grammar_text), plus lenient:
# keywords a grammar cannot enforce (uniqueItems) are ignored, as xgrammar ignores them, so
# both libraries work on the same schemas. Cadence's settings refuse them today; the
# adapter's strict_refusal says which schemas they refuse.
LLGUIDANCE_JSON_OPTIONS: Any = dict(whitespace_flexible=False, item_separator=", ", key_separator=": ", lenient=True)


class EngineAdapter:
    """One grammar library: tokenizer setup, schema compile, matchers, masks, tokens."""

    name: str
    library_version: str

    def build_tokenizer(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        raise NotImplementedError

    def compile(self, schema_text: str) -> Any:
        """The compiled form of the schema; raises with the library's message when it cannot."""
        raise NotImplementedError

    def new_matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def fill(self, matcher: Any, bitmask: NDArray[np.int32], row: int) -> None:
        raise NotImplementedError

    def fill_batch(self, matchers: list[Any], rows: list[int], bitmask: NDArray[np.int32]) -> None:
        """Every matcher's mask into its row, with the library's parallel batch call."""
        raise NotImplementedError

    def consume(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def consume_batch(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        raise NotImplementedError

    def error(self, matcher: Any) -> str:
        return ""

    def strict_refusal(self, schema_text: str) -> str:
        return ""

    def compiled_bytes(self, compiled: Any) -> int | None:
        """The library's own count of a compiled grammar's memory, where it keeps one."""
        return None


class LLGuidanceAdapter(EngineAdapter):
    def __init__(self, threads: int) -> None:
        import llguidance
        import llguidance.numpy

        self.name = "llguidance"
        self.library_version = _version("llguidance")
        self._llg = llguidance
        self._fill = llguidance.numpy.fill_next_token_bitmask
        self._fill_par = llguidance.numpy.fill_next_token_bitmask_par
        self._consume_par = llguidance.numpy.consume_token_par
        self._executor = llguidance.LLExecutor(num_threads=threads)

    def build_tokenizer(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        from cadence.structured_outputs.grammar import ll_tokenizer

        self._tokenizer = ll_tokenizer(hf_tokenizer.backend_tokenizer.to_str(), vocab_size, eos_token_ids)

    def compile(self, schema_text: str) -> Any:
        from cadence.structured_outputs.grammar import parser_limits

        grammar = self._llg.LLMatcher.grammar_from_json_schema(schema_text, overrides=LLGUIDANCE_JSON_OPTIONS)
        matcher = self._llg.LLMatcher(self._tokenizer, grammar, limits=parser_limits(), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def new_matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: NDArray[np.int32], row: int) -> None:
        self._fill(matcher, bitmask, row)

    def fill_batch(self, matchers: list[Any], rows: list[int], bitmask: NDArray[np.int32]) -> None:
        self._fill_par(self._executor, list(zip(matchers, rows)), bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def consume_batch(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return list(self._consume_par(self._executor, list(zip(matchers, tokens))))

    def error(self, matcher: Any) -> str:
        return str(matcher.get_error())

    def strict_refusal(self, schema_text: str) -> str:
        """Why Cadence's own `grammar_text` and `check_grammar` refuse the schema; '' when they take it."""
        from cadence.structured_outputs.grammar import GrammarError, check_grammar, grammar_text
        from cadence.structured_outputs.params import StructuredOutputsParams

        try:
            check_grammar(grammar_text(StructuredOutputsParams(json=schema_text)), self._tokenizer)
        except GrammarError as error:
            return str(error).splitlines()[0][:200]
        except Exception as error:  # noqa: BLE001 - not the GrammarError a 400 is made from: a finding
            return f"{type(error).__name__} (not GrammarError): {str(error)[:150]}"
        return ""


class XGrammarAdapter(EngineAdapter):
    def __init__(self, threads: int, dynamic: bool) -> None:
        import xgrammar

        self.name = "xgrammar-dynamic" if dynamic else "xgrammar"
        self.library_version = _version("xgrammar")
        self._xgr = xgrammar
        self._threads = threads
        self._dynamic = dynamic
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def build_tokenizer(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        info = self._xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids
        )
        self._compiler = self._xgr.GrammarCompiler(
            info, max_threads=self._threads, cache_enabled=False, enable_dynamic_compilation=self._dynamic
        )

    def compile(self, schema_text: str) -> Any:
        return self._compiler.compile_json_schema(
            schema_text, any_whitespace=False, separators=SEPARATORS, strict_mode=True
        )

    def new_matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: NDArray[np.int32], row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list[Any], rows: list[int], bitmask: NDArray[np.int32]) -> None:
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def consume_batch(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return self._xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def compiled_bytes(self, compiled: Any) -> int | None:
        return int(compiled.memory_size_bytes)


def _version(distribution: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(distribution)


def load_adapter(name: str, threads: int) -> tuple[EngineAdapter, float]:
    """The adapter and the seconds its library took to import (including what it imports, torch for xgrammar)."""
    start = time.perf_counter()
    adapter: EngineAdapter
    if name == "llguidance":
        adapter = LLGuidanceAdapter(threads)
    elif name in ("xgrammar", "xgrammar-dynamic"):
        adapter = XGrammarAdapter(threads, dynamic=name == "xgrammar-dynamic")
    else:
        raise ValueError(f"unknown engine {name!r}; choose from {ENGINES}")
    return adapter, time.perf_counter() - start


def allocate_bitmask(batch: int, vocab_size: int) -> NDArray[np.int32]:
    return np.full((batch, (vocab_size + 31) // 32), -1, dtype=np.int32)


def allows(bitmask: NDArray[np.int32], row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)

"""From a request's constraint fields to the engine's StructuredOutputsParams, checked.

A request may constrain its output in OpenAI's form (`response_format`), vLLM's
(`structured_outputs`) or vLLM's older one (`guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`); at most one of them. The grammar it makes is built
and checked here, in the API process, before anything is queued: a schema, regex or
grammar the library refuses, or one that does not compile in time, is a 400 naming the
field that sent it, and never reaches the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance

from cadence.openai_schema.requests import SamplingFields
from cadence.server.errors import APIError, bad_request
from cadence.structured_outputs.grammar import GrammarError, check_grammar, grammar_text, ll_tokenizer
from cadence.structured_outputs.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Grammars are checked on threads of their own (llguidance drops the GIL): a slow one
# never holds up tokenization, and a few pathological requests cannot take every thread.
CHECK_THREADS = 4
# Constraints that passed, by cache key: clients send the same schema again and again, and
# checking one again would cost as much as the first time.
PASSED_KEYS = 512


@dataclass(frozen=True)
class Constraint:
    """What the output must match, and the request field that asked for it (a 400's param)."""

    params: StructuredOutputsParams
    param: str


def _constraint(param: str, **fields: object) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(**fields), param)  # type: ignore[arg-type]
    except ValueError as error:
        raise bad_request(str(error), param) from error


def requested_constraint(body: SamplingFields) -> Constraint | None:
    """The request's one constraint, or None; 400 when it names more than one."""
    found: list[Constraint] = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(_constraint("response_format", json_object=True))
    elif response_format is not None and response_format.type == "json_schema":
        assert response_format.json_schema is not None
        found.append(_constraint("response_format", json=response_format.json_schema.json_schema))
    fields = body.structured_outputs
    if fields is not None:
        found.append(
            _constraint(
                "structured_outputs",
                json=fields.json_schema,
                regex=fields.regex,
                choice=None if fields.choice is None else tuple(fields.choice),
                grammar=fields.grammar,
                json_object=bool(fields.json_object),
            )
        )
    if body.guided_json is not None:
        found.append(_constraint("guided_json", json=body.guided_json))
    if body.guided_regex is not None:
        found.append(_constraint("guided_regex", regex=body.guided_regex))
    if body.guided_choice is not None:
        found.append(_constraint("guided_choice", choice=tuple(body.guided_choice)))
    if body.guided_grammar is not None:
        found.append(_constraint("guided_grammar", grammar=body.guided_grammar))
    if len(found) > 1:
        raise bad_request(
            f"{found[0].param} and {found[1].param} both constrain the output; send only one of them", found[1].param
        )
    return found[0] if found else None


class GrammarChecker:
    """Builds and checks constraints' grammars against the model's tokenizer.

    llguidance's view of the tokenizer takes about a second to build, so it is built once,
    from the start, on the checker's threads. A model without a tokenizer still gets its grammars'
    syntax checked.
    """

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_token_ids: list[int], timeout: float) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.timeout = timeout
        self._executor = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="grammar-check")
        # Built from the start, so the first constrained request does not wait for it.
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        if tokenizer_json is not None:
            self._tokenizer = self._executor.submit(ll_tokenizer, tokenizer_json, vocab_size, eos_token_ids)
        self._passed: OrderedDict[str, None] = OrderedDict()

    def close(self) -> None:
        # A thread still on a pathological grammar finishes on its own; nobody waits.
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _ll_tokenizer(self) -> llguidance.LLTokenizer | None:
        if self._tokenizer is None:
            return None
        try:
            return await asyncio.wrap_future(self._tokenizer)
        except Exception:
            # A tokenizer llguidance cannot read must not fail every constrained request:
            # their syntax is still checked here, and the engine compiles them as usual.
            if self._tokenizer is not None:
                logger.exception("llguidance cannot read the tokenizer; grammars are checked for syntax only")
                self._tokenizer = None
            return None

    async def check(self, constraint: Constraint) -> None:
        """400 naming `constraint.param` when its grammar is refused or does not compile
        within the time limit."""
        try:
            key = constraint.params.cache_key()
        except RecursionError:
            # Python's own JSON encoder gives up on a schema nested a thousand levels deep.
            raise bad_request(f"{constraint.param}: the schema is nested too deeply", constraint.param) from None
        if key in self._passed:
            self._passed.move_to_end(key)
            return
        tokenizer = await self._ll_tokenizer()
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._executor, _build_and_check, constraint.params, tokenizer)
        try:
            await asyncio.wait_for(work, self.timeout)
        except GrammarError as error:
            raise bad_request(f"{constraint.param}: {error}", constraint.param) from error
        except asyncio.TimeoutError as error:  # TimeoutError itself from Python 3.11 on
            raise APIError(
                400,
                f"{constraint.param}: the grammar did not compile within {self.timeout:g} s "
                "(--structured-outputs-compile-timeout); simplify the schema, regex or grammar",
                param=constraint.param,
            ) from error
        self._passed[key] = None
        if len(self._passed) > PASSED_KEYS:
            self._passed.popitem(last=False)


def _build_and_check(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer | None) -> None:
    check_grammar(grammar_text(params), tokenizer)

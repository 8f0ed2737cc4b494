"""What one grammar engine measures in its own process, so memory figures do not mix.

`measure_workload`: tokenizer setup, a cold compile of every schema, then masks while
walking each example's tokens at batch 1, and at batch 64 both with the library's
parallel batch call and one matcher after another. `measure_hostile`: one hostile schema's
compile and, when it compiles, a walk of its probe. Both return plain dicts (JSON).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from common.grammar_engine_adapters import EngineAdapter, allocate_bitmask, allows, load_adapter

BATCH_STEPS = 300  # decode steps timed at batch 64, every slot busy at every step


def rss_mib() -> tuple[float, float]:
    """This process's resident memory now and at its peak, MiB (from /proc)."""
    values = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


@dataclass
class Setup:
    adapter: EngineAdapter
    hf_tokenizer: Any
    vocab_size: int
    eos: int
    token_bytes: list[bytes]  # each token's UTF-8 bytes ('' for special and partial-character tokens)
    facts: dict[str, Any]


def set_up(engine: str, threads: int, model_path: str) -> Setup:
    """The engine with its tokenizer built, and what that cost (import, tokenizer, memory)."""
    had_torch = "torch" in sys.modules
    adapter, import_s = load_adapter(engine, threads)
    imports_torch = not had_torch and "torch" in sys.modules
    from cadence.tokenization.loading import load_tokenizer

    hf_tokenizer = load_tokenizer(model_path)
    if hf_tokenizer is None:
        raise SystemExit(f"{model_path} has no tokenizer")
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        vocab_size = int(json.load(f)["vocab_size"])
    eos = int(hf_tokenizer.eos_token_id)
    rss_before, _ = rss_mib()
    start = time.perf_counter()
    adapter.build_tokenizer(hf_tokenizer, vocab_size, [eos])
    tokenizer_s = time.perf_counter() - start
    facts = dict(
        engine=engine,
        version=adapter.library_version,
        import_s=import_s,
        imports_torch=imports_torch,
        tokenizer_s=tokenizer_s,
        tokenizer_mib=rss_mib()[0] - rss_before,
        vocab_size=vocab_size,
    )
    token_bytes = [_token_bytes(hf_tokenizer, token) for token in range(vocab_size)]
    return Setup(adapter, hf_tokenizer, vocab_size, eos, token_bytes, facts)


def _token_bytes(hf_tokenizer: Any, token: int) -> bytes:
    text = hf_tokenizer.decode([token])
    return b"" if "\ufffd" in text or token in hf_tokenizer.all_special_ids else text.encode()


def _ns_to_us(values: list[int]) -> list[float]:
    return [v / 1000 for v in values]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _longest_allowed_prefix(setup: Setup, bitmask: NDArray[np.int32], rest: bytes) -> int | None:
    """The longest token the mask allows whose bytes begin `rest`, or None."""
    allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[: setup.vocab_size])
    fitting = [int(t) for t in allowed if setup.token_bytes[t] and rest.startswith(setup.token_bytes[t])]
    return max(fitting, key=lambda t: len(setup.token_bytes[t])) if fitting else None


@dataclass
class Walk:
    tokens: list[int]  # the tokens consumed, the example's own tokenization where the mask allowed it
    fill_ns: list[int]
    consume_ns: list[int]
    resyncs: int  # times the mask refused the example's next token and another tokenization was taken
    failure: str  # why the walk stopped early; '' when it reached EOS


def walk_one(setup: Setup, matcher: Any, text: str, bitmask: NDArray[np.int32]) -> Walk:
    """Masks then tokens along `text`'s tokenization, then the final mask (which must allow EOS).

    A library may allow only its own tokenization of bytes the grammar forces (llguidance
    does): when the mask refuses the example's next token, the walk takes the longest
    allowed token that spells the same bytes and tokenizes the rest again, as a model
    sampling under the mask would go on."""
    adapter = setup.adapter
    encode = setup.hf_tokenizer.encode
    data = text.encode()
    ids: list[int] = encode(text, add_special_tokens=False)
    walk = Walk([], [], [], 0, "")
    done = 0  # bytes of `data` consumed so far
    while True:
        start = time.perf_counter_ns()
        adapter.fill(matcher, bitmask, 0)
        walk.fill_ns.append(time.perf_counter_ns() - start)
        if not ids:
            if not allows(bitmask, 0, setup.eos):
                walk.failure = f"mask refused EOS at the end: {adapter.error(matcher)[:200]}"
            return walk
        token = ids[0]
        if not allows(bitmask, 0, token):
            alternative = _longest_allowed_prefix(setup, bitmask, data[done:])
            rest = data[done + len(setup.token_bytes[alternative]) :] if alternative is not None else b""
            try:
                rest_ids = encode(rest.decode(), add_special_tokens=False)
            except UnicodeDecodeError:
                alternative = None
            if alternative is None:
                shown = setup.hf_tokenizer.decode([token])
                walk.failure = f"mask refused {shown!r} at token {len(walk.tokens)}: {adapter.error(matcher)[:200]}"
                return walk
            token, ids, walk.resyncs = alternative, [alternative, *rest_ids], walk.resyncs + 1
        start = time.perf_counter_ns()
        ok = adapter.consume(matcher, token)
        walk.consume_ns.append(time.perf_counter_ns() - start)
        if not ok:
            walk.failure = f"consume refused token {len(walk.tokens)}: {adapter.error(matcher)[:200]}"
            return walk
        walk.tokens.append(token)
        done += len(setup.token_bytes[token])
        ids = ids[1:]


def _batch_walk(
    setup: Setup, compiled: list[Any], token_lists: list[list[int]], batch: int, parallel: bool
) -> dict[str, Any]:
    """BATCH_STEPS steps with `batch` busy slots; a slot whose example ends takes the next schema."""
    adapter = setup.adapter
    bitmask = allocate_bitmask(batch, setup.vocab_size)
    next_schema = batch
    slot_schema = [i % len(compiled) for i in range(batch)]
    matchers = [adapter.new_matcher(compiled[s]) for s in slot_schema]
    positions = [0] * batch
    rows = list(range(batch))
    fill_ns, consume_ns, refused = [], 0, 0
    for _ in range(BATCH_STEPS):
        start = time.perf_counter_ns()
        if parallel:
            adapter.fill_batch(matchers, rows, bitmask)
        else:
            for row, matcher in enumerate(matchers):
                adapter.fill(matcher, bitmask, row)
        fill_ns.append(time.perf_counter_ns() - start)
        tokens = []
        for row in rows:
            ids = token_lists[slot_schema[row]]
            token = ids[positions[row]] if positions[row] < len(ids) else setup.eos
            refused += not allows(bitmask, row, token)
            tokens.append(token)
        start = time.perf_counter_ns()
        if parallel:
            adapter.consume_batch(matchers, tokens)
        else:
            for matcher, token in zip(matchers, tokens):
                adapter.consume(matcher, token)
        consume_ns += time.perf_counter_ns() - start
        for row in rows:
            positions[row] += 1
            if positions[row] > len(token_lists[slot_schema[row]]):  # its EOS was just consumed
                slot_schema[row] = next_schema % len(compiled)
                next_schema += 1
                matchers[row] = adapter.new_matcher(compiled[slot_schema[row]])
                positions[row] = 0
    steps_us = _ns_to_us(fill_ns)
    return dict(
        step_ms_p50=statistics.median(steps_us) / 1000,
        step_ms_p99=_quantile(steps_us, 0.99) / 1000,
        fill_us_per_token=sum(steps_us) / (BATCH_STEPS * batch),
        consume_us_per_token=consume_ns / 1000 / (BATCH_STEPS * batch),
        refused=refused,
    )


def measure_workload(engine: str, threads: int, batch: int, model_path: str, schema_set: list[Any]) -> dict[str, Any]:
    setup = set_up(engine, threads, model_path)
    adapter = setup.adapter
    result: dict[str, Any] = dict(setup.facts)
    rss_start, _ = rss_mib()
    compile_s: list[float] = []
    compiled: list[Any] = []
    names: list[str] = []
    failures: dict[str, str] = {}
    texts = {named.name: json.dumps(named.schema) for named in schema_set}
    for named in schema_set:
        start = time.perf_counter()
        try:
            item = adapter.compile(texts[named.name])
        except Exception as error:  # noqa: BLE001 - a library's refusal is reported per schema
            failures[named.name] = f"compile: {str(error).splitlines()[0][:200]}"
            continue
        compile_s.append(time.perf_counter() - start)
        compiled.append(item)
        names.append(named.name)
    result["compile_rss_mib"] = rss_mib()[0] - rss_start
    sizes = [adapter.compiled_bytes(c) for c in compiled]
    known = [s for s in sizes if s is not None]
    result["compiled_mib"] = sum(known) / 2**20 if len(known) == len(sizes) else None
    by_name = {s.name: s for s in schema_set}
    bitmask = allocate_bitmask(1, setup.vocab_size)
    first_fill_us, later_fill_us, consume_us, new_matcher_us = [], [], [], []
    walked_compiled, walked_tokens, resyncs = [], [], 0
    for name, item in zip(names, compiled):
        start = time.perf_counter_ns()
        matcher = adapter.new_matcher(item)
        new_matcher_us.append((time.perf_counter_ns() - start) / 1000)
        walk = walk_one(setup, matcher, by_name[name].example_text(), bitmask)
        first_fill_us.append(walk.fill_ns[0] / 1000)
        later_fill_us += _ns_to_us(walk.fill_ns[1:])
        consume_us += _ns_to_us(walk.consume_ns)
        resyncs += walk.resyncs
        if walk.failure:
            failures[name] = walk.failure
        else:
            walked_compiled.append(item)
            walked_tokens.append(walk.tokens)
    strict_refusals = {name: why for name, text in texts.items() if (why := adapter.strict_refusal(text))}
    result.update(
        schemas=len(schema_set),
        compiled=len(compiled),
        walked=len(walked_compiled),
        failures=failures,
        strict_refusals=strict_refusals,
        resyncs=resyncs,
        compile_ms=[s * 1000 for s in compile_s],
        first_fill_us=first_fill_us,
        fill_us=later_fill_us,
        consume_us=consume_us,
        new_matcher_us=new_matcher_us,
        tokens_walked=sum(len(t) + 1 for t in walked_tokens),
    )
    result["batch_parallel"] = _batch_walk(setup, walked_compiled, walked_tokens, batch, parallel=True)
    result["batch_sequential"] = _batch_walk(setup, walked_compiled, walked_tokens, batch, parallel=False)
    rss_end, peak = rss_mib()
    result.update(after_walks_rss_mib=rss_end - rss_start, peak_rss_mib=peak)
    return result


def measure_hostile(engine: str, threads: int, model_path: str, case: Any) -> dict[str, Any]:
    setup = set_up(engine, threads, model_path)
    adapter = setup.adapter
    result: dict[str, Any] = dict(engine=engine, case=case.name, cadence_check=adapter.strict_refusal(case.schema_text))
    rss_start, _ = rss_mib()
    start = time.perf_counter()
    try:
        compiled = adapter.compile(case.schema_text)
    except Exception as error:  # noqa: BLE001 - the library's refusal is the outcome measured
        result.update(outcome="refused", compile_s=time.perf_counter() - start, error=str(error).splitlines()[0][:160])
        result["rss_mib"] = rss_mib()[0] - rss_start
        return result
    result["compile_s"] = time.perf_counter() - start
    result["compile_rss_mib"] = rss_mib()[0] - rss_start
    walk_start = time.perf_counter()
    walk = walk_one(setup, adapter.new_matcher(compiled), case.probe_text, allocate_bitmask(1, setup.vocab_size))
    fill_us = _ns_to_us(walk.fill_ns)
    result.update(
        outcome="walk failed" if walk.failure else "ok",
        error=walk.failure,
        walk_s=time.perf_counter() - walk_start,
        tokens=len(walk.fill_ns),
        fill_us_mean=statistics.fmean(fill_us),
        fill_us_max=max(fill_us),
        rss_mib=rss_mib()[0] - rss_start,
    )
    return result

"""Structured outputs composed with the rest of the engine: n > 1, preemption, prefix
caching, mixed batches, stop rules, logit_bias, grammars that fail or compile slowly, and
disaggregation (the decode engine owns the matcher)."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from cadence import LLM, SamplingParams
from cadence.engine.core_process import EngineCoreLoop
from cadence.engine.engine_args import EngineArgs
from cadence.engine.engine_core import EngineCore
from cadence.engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, Shutdown, decode, encode
from cadence.engine.structured_output import manager as manager_module
from cadence.engine.structured_output.manager import StructuredOutputManager
from cadence.server.disaggregation.local_cluster import LocalCluster
from cadence.structured_outputs.params import StructuredOutputsParams
from tests.engine.test_disaggregation import engine as disaggregation_engine
from tests.engine.test_disaggregation import run as run_cluster
from tests.support.helpers import TINY_ENGINE, greedy, make_llm

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "size": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["name", "tags", "size"],
    "additionalProperties": False,
}
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(5 + 6 * i)] for i in range(4)]
ENGINE = {"max_model_len": 256, "num_gpu_blocks": 512}


def valid(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"name", "tags", "size"}
        and len(value["name"]) <= 6
        and 1 <= len(value["tags"]) <= 3
        and set(value["tags"]) <= {"a", "b", "c"}
        and 1 <= value["size"] <= 99
    )


def constrained(max_tokens: int = 120, **options: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA), **options
    )


@pytest.fixture(scope="module")
def path(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(path: str) -> LLM:
    return make_llm(path, **ENGINE)


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[list[int]]:
    """Each prompt's constrained greedy tokens, run on its own."""
    tokens = []
    for prompt in PROMPTS:
        (output,) = llm.generate([prompt], constrained())
        assert output.outputs[0].finish_reason == "stop" and valid(output.outputs[0].text)
        tokens.append(output.outputs[0].token_ids)
    return tokens


def test_constrained_greedy_is_the_same_alone_and_in_a_mixed_batch(llm: LLM, alone: list[list[int]]) -> None:
    sampled = SamplingParams(max_tokens=30, temperature=1.0, seed=3)
    choice = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=("yes", "no")))
    prompts = [*PROMPTS, PROMPTS[0], PROMPTS[1]]
    outputs = llm.generate(prompts, [constrained()] * len(PROMPTS) + [sampled, choice])
    assert [o.outputs[0].token_ids for o in outputs[: len(PROMPTS)]] == alone
    assert outputs[-1].outputs[0].text in ("yes", "no")
    assert outputs[-2].outputs[0].finish_reason == "length"  # the unconstrained row is unconstrained


def test_preemption_keeps_the_matchers_in_step(path: str, alone: list[list[int]]) -> None:
    tight = make_llm(path, max_model_len=128, num_gpu_blocks=40, max_num_batched_tokens=8)
    outputs = tight.generate(PROMPTS, constrained())
    assert tight.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == alone


def test_prefix_cache_hits_change_nothing(llm: LLM, alone: list[list[int]]) -> None:
    (first,) = llm.generate([PROMPTS[3]], constrained())
    (again,) = llm.generate([PROMPTS[3]], constrained())
    assert again.num_cached_tokens > 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == alone[3]


def test_every_sequence_of_n_follows_the_grammar(llm: LLM) -> None:
    params = SamplingParams(
        n=4, max_tokens=120, temperature=1.0, seed=7, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    (output,) = llm.generate([PROMPTS[2]], params)
    texts = [c.text for c in output.outputs]
    assert all(c.finish_reason == "stop" for c in output.outputs)
    assert all(valid(text) for text in texts)
    assert len(set(texts)) > 1  # the siblings sampled apart


def test_grammar_wins_over_min_tokens_and_ends_with_stop_despite_ignore_eos(llm: LLM) -> None:
    choices = ("yes", "no")
    for options in ({"min_tokens": 10}, {"ignore_eos": True}):
        params = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(choice=choices), **options)
        (output,) = llm.generate([PROMPTS[0]], params)
        completion = output.outputs[0]
        assert completion.text in choices and completion.finish_reason == "stop"
        assert len(completion.token_ids) < 10


def test_stop_strings_cut_constrained_output(llm: LLM) -> None:
    params = SamplingParams(max_tokens=20, stop=["-"], structured_outputs=StructuredOutputsParams(regex="ab-cd"))
    (output,) = llm.generate([PROMPTS[0]], params)
    assert output.outputs[0].text == "ab" and output.outputs[0].finish_reason == "stop"


def test_logit_bias_forces_and_bans_tokens_for_every_request_kind(llm: LLM) -> None:
    (plain,) = llm.generate([PROMPTS[1]], greedy(6))
    unbiased = plain.outputs[0].token_ids
    forced = next(t for t in range(3, 500) if t not in unbiased)
    for params in (greedy(6), SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)):
        params.logit_bias = {forced: 100.0}
        (output,) = llm.generate([PROMPTS[1]], params)
        assert output.outputs[0].token_ids == [forced] * 6
    (banned,) = llm.generate([PROMPTS[1]], greedy(6, logit_bias={unbiased[0]: -100.0}))
    assert banned.outputs[0].token_ids[0] != unbiased[0]
    assert unbiased[0] not in banned.outputs[0].token_ids
    # A bias never lets a token past the grammar.
    choice = SamplingParams(
        max_tokens=8, logit_bias={forced: 100.0}, structured_outputs=StructuredOutputsParams(choice=("yes", "no"))
    )
    (output,) = llm.generate([PROMPTS[1]], choice)
    assert output.outputs[0].text in ("yes", "no")
    # Each request's bias tensors, built once, go when it has finished.
    assert llm.engine.runner.logit_biases
    llm.generate([PROMPTS[1]], greedy(1))
    assert not llm.engine.runner.logit_biases


def test_logit_bias_outside_the_vocabulary_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="logit_bias token id 512 is outside the vocabulary"):
        llm.generate([PROMPTS[0]], greedy(2, logit_bias={512: 1.0}))


def test_logprobs_stay_those_of_the_model(llm: LLM) -> None:
    """A constrained row reports the model's own logprobs of the tokens it sampled: what
    the model gives those tokens as a prompt."""
    (output,) = llm.generate([PROMPTS[0]], constrained(max_tokens=10, logprobs=0))
    tokens, logprobs = output.outputs[0].token_ids, output.outputs[0].logprobs
    assert logprobs is not None
    (scored,) = llm.generate([PROMPTS[0] + tokens], greedy(1, prompt_logprobs=0))
    assert scored.prompt_logprobs is not None
    for position, token in enumerate(tokens):
        expected = scored.prompt_logprobs[len(PROMPTS[0]) + position][token].logprob
        assert logprobs[position][token].logprob == pytest.approx(expected, abs=1e-4)


def engine_core(path: str, **options: Any) -> EngineCore:
    return EngineCore(EngineArgs(path, **{**TINY_ENGINE, **options}))


def run_engine(core: EngineCore) -> tuple[dict[str, list[EngineCoreOutput]], dict[str, str]]:
    outputs: dict[str, list[EngineCoreOutput]] = {}
    failed: dict[str, str] = {}
    while core.has_unfinished_requests():
        if not core.has_work():
            core.structured.wait()
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
        failed.update(core.take_failed_requests())
    return outputs, failed


def test_a_grammar_the_engine_cannot_compile_fails_its_request_alone(path: str) -> None:
    core = engine_core(path)
    bad = SamplingParams(n=2, max_tokens=5, structured_outputs=StructuredOutputsParams(grammar="start: foo"))
    core.add_request(EngineCoreRequest("bad", PROMPTS[0], bad))
    core.add_request(EngineCoreRequest("good", PROMPTS[1], greedy(5)))
    outputs, failed = run_engine(core)
    assert set(failed) == {"bad"} and "foo" in failed["bad"]
    assert "bad" not in outputs
    assert sum(len(o.new_token_ids) for o in outputs["good"]) == 5
    assert not core.structured.matchers and not core.scheduler.requests
    # Every failed sequence is forgotten, so its request id is free again.
    assert core._sequences == {} and core._children == {}
    core.add_request(EngineCoreRequest("bad", PROMPTS[0], greedy(3)))
    outputs, failed = run_engine(core)
    assert not failed and sum(len(o.new_token_ids) for o in outputs["bad"]) == 3


class SlowCompiles:
    """Holds every grammar compile until released; `started` counts the compiles begun."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        compile_grammar = StructuredOutputManager._compile

        def slow(manager: StructuredOutputManager, params: StructuredOutputsParams) -> Any:
            self.started.release()
            self.release.wait(30)
            return compile_grammar(manager, params)

        monkeypatch.setattr(StructuredOutputManager, "_compile", slow)


def test_a_compiling_grammar_holds_up_no_other_request(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    compiles = SlowCompiles(monkeypatch)
    core = engine_core(path, max_model_len=256, num_gpu_blocks=256)
    core.add_request(EngineCoreRequest("constrained", PROMPTS[0], constrained()))
    core.add_request(EngineCoreRequest("plain", PROMPTS[1], greedy(5)))
    assert core.stats().num_waiting == 2
    plain_tokens = []
    while "plain" in core.scheduler.requests:
        plain_tokens += [t for out in core.step() for t in out.new_token_ids]
        assert "constrained" not in core.scheduler.requests
    assert len(plain_tokens) == 5
    assert not core.has_work() and core.has_unfinished_requests()
    compiles.release.set()
    outputs, failed = run_engine(core)
    assert not failed
    assert outputs["constrained"][-1].finish_reason == "stop"


def test_a_grammar_past_its_compile_timeout_fails_its_request(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    compiles = SlowCompiles(monkeypatch)
    core = engine_core(path, structured_outputs_compile_timeout=0.05)
    core.add_request(EngineCoreRequest("slow", PROMPTS[0], constrained()))
    core.add_request(EngineCoreRequest("plain", PROMPTS[1], greedy(3)))
    outputs, failed = run_engine(core)
    compiles.release.set()
    assert set(failed) == {"slow"} and "did not compile within 0.05 s" in failed["slow"]
    assert sum(len(o.new_token_ids) for o in outputs["plain"]) == 3


def test_the_compile_timeout_counts_from_when_the_compile_starts(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar queued behind a slow compile on the one compile thread is not failed for
    the time it waited: its timeout starts with its own compile."""
    monkeypatch.setattr(manager_module, "COMPILE_THREADS", 1)
    compiles = SlowCompiles(monkeypatch)
    core = engine_core(path, structured_outputs_compile_timeout=0.5)
    core.add_request(EngineCoreRequest("slow", PROMPTS[0], constrained()))
    regex = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]{3}"))
    core.add_request(EngineCoreRequest("queued", PROMPTS[1], regex))
    failed: dict[str, str] = {}
    while "slow" not in failed:
        if not core.has_work():
            core.structured.wait()
        core.step()
        failed.update(core.take_failed_requests())
    assert set(failed) == {"slow"}  # "queued" waited as long, but its compile has not begun
    compiles.release.set()
    outputs, failed = run_engine(core)
    assert not failed and outputs["queued"][-1].finish_reason == "stop"


def test_grammars_held_requests_wait_for_outlast_a_full_cache(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """More grammars finish at once than the cache holds: each held request still gets its
    own, none is evicted before its requests take it."""
    monkeypatch.setattr(manager_module, "MAX_CACHED_GRAMMARS", 1)
    compiles = SlowCompiles(monkeypatch)
    core = engine_core(path, structured_outputs_compile_timeout=30)
    for name, pattern in (("a", "[ab]{3}"), ("b", "[cd]{3}")):
        params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex=pattern))
        core.add_request(EngineCoreRequest(name, PROMPTS[0], params))
    assert compiles.started.acquire(timeout=30) and compiles.started.acquire(timeout=30)
    compiles.release.set()
    concurrent.futures.wait(list(core.structured._compiling.values()), timeout=30)
    core.step()  # both compiles are taken up in the same step
    assert core.structured.num_held == 0
    outputs, failed = run_engine(core)
    assert not failed and {outputs[name][-1].finish_reason for name in "ab"} == {"stop"}
    assert len(core.structured._compiled) == 1


def test_disaggregated_constrained_output_matches_colocated(path: str) -> None:
    """The prefill engine samples nothing; the decode engine samples every token and owns
    the matcher, so its output is the colocated one."""
    long_prompts = [[(11 * i + j) % 500 + 3 for j in range(40 + 9 * i)] for i in range(3)]
    requests = [EngineCoreRequest(f"r{i}", p, constrained()) for i, p in enumerate(long_prompts)]
    colocated = disaggregation_engine(path)
    for request in requests:
        colocated.add_request(request)
    expected, _ = run_engine(colocated)
    cluster = LocalCluster([disaggregation_engine(path, "prefill")], [disaggregation_engine(path, "decode")])
    tokens, _ = run_cluster(cluster, requests)
    assert cluster.coordinator.stats.num_remote_prefills >= 1
    assert tokens == {f"{rid}/0": [t for o in outs for t in o.new_token_ids] for rid, outs in expected.items()}


def test_the_engine_loop_waits_for_a_compile_and_reports_a_failed_grammar(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the engine process's sockets (msgpacked requests): a request whose grammar
    compiles while the loop is otherwise idle still runs, and one whose grammar the
    engine cannot compile comes back as rejected, with the reason."""
    compiles = SlowCompiles(monkeypatch)
    core = engine_core(path, max_model_len=256, num_gpu_blocks=256)
    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inputs.bind("inproc://inputs")
    outputs.bind("inproc://outputs")
    send, receive = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    send.connect("inproc://inputs")
    receive.connect("inproc://outputs")
    loop = threading.Thread(target=EngineCoreLoop(core, inputs, outputs).run)
    loop.start()
    try:
        bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(grammar="start: foo"))
        send.send(encode(EngineCoreRequest("bad", PROMPTS[0], bad)))
        send.send(encode(EngineCoreRequest("good", PROMPTS[1], constrained())))
        # Both compiles run (on the pool's two threads) while the loop has nothing else to do.
        assert compiles.started.acquire(timeout=30) and compiles.started.acquire(timeout=30)
        compiles.release.set()
        rejected: dict[str, str] = {}
        finish_reason = None
        while finish_reason is None or "bad" not in rejected:
            assert receive.poll(30_000), "the engine loop went quiet"
            message = decode(receive.recv())
            assert isinstance(message, EngineCoreOutputs)
            rejected.update(message.rejected)
            finish_reason = next((o.finish_reason for o in message.outputs if o.finished), finish_reason)
        assert "foo" in rejected["bad"] and finish_reason == "stop"
    finally:
        compiles.release.set()
        send.send(encode(Shutdown()))
        loop.join(30)
        for socket in (inputs, outputs, send, receive):
            socket.close(linger=0)
        context.term()

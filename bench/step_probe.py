"""Per-step phase timings of a Cadence engine, taken without editing the engine."""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from cadence import LLM
from cadence.engine.model_runner import ModelRunnerOutput
from cadence.engine.protocol import EngineCoreOutput
from cadence.scheduler.scheduler import SchedulerOutput


class StepProbe:
    """Times each engine step's phases by wrapping methods on this engine's objects.

    Nothing in the engine is edited: the wrappers are instance attributes that shadow
    the class methods. Per step it records schedule / execute / update (as the engine's
    own StepTimings does), and inside execute: model forward (all layers, attention
    included), compute_logits (the lm_head GEMM) and _sample (sampling metadata, the
    sampler, .tolist()). Input preparation = execute - forward - logits - sample. The
    time between steps inside LLM.generate (its output processor) is `outproc`.
    """

    def __init__(self, llm: LLM) -> None:
        self.records: list[dict[str, float]] = []
        self._cur: dict[str, float] | None = None
        self._last_end: float | None = None
        engine = llm.engine
        runner = engine.runner
        model = runner.model
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine, "_update", "update")
        self._wrap(model, "forward", "forward")
        self._wrap(model, "compute_logits", "logits")
        self._wrap(runner, "_sample", "sample")

        execute = runner.execute

        def timed_execute(output: SchedulerOutput) -> ModelRunnerOutput:
            cur = self._cur
            if cur is not None:
                cur["num_seqs"] = len(output.scheduled)
                cur["num_tokens"] = sum(s.num_new_tokens for s in output.scheduled)
                cur["num_decodes"] = sum(1 for s in output.scheduled if s.num_new_tokens == 1)
            t0 = time.perf_counter()
            try:
                return execute(output)
            finally:
                if cur is not None:
                    cur["execute"] += time.perf_counter() - t0

        runner.execute = timed_execute  # type: ignore[method-assign]

        step = engine.step

        def timed_step() -> list[EngineCoreOutput]:
            t0 = time.perf_counter()
            # The gap since the previous step ended is LLM.generate processing its outputs.
            if self._last_end is not None and self.records:
                self.records[-1]["outproc"] = t0 - self._last_end
            cur: dict[str, float] = defaultdict(float)
            self._cur = cur
            try:
                return step()
            finally:
                end = time.perf_counter()
                cur["step"] = end - t0
                self.records.append(cur)
                self._cur = None
                self._last_end = end

        engine.step = timed_step  # type: ignore[method-assign]

    def _wrap(self, obj: object, attr: str, key: str) -> None:
        fn: Callable[..., Any] = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._cur is not None:
                    self._cur[key] += time.perf_counter() - t0

        setattr(obj, attr, timed)

    def reset(self) -> None:
        """Forget earlier steps (the warm-up), so records cover only the timed run."""
        self.records = []
        self._last_end = None

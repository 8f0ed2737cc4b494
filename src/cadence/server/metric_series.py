"""Every series /metrics exports: name, type, meaning, labels and buckets, in one place.

The exporters (server/metrics.py, server/request_metrics.py) and the Grafana dashboard
build their names from these, so a panel's query and the series it reads cannot drift
apart. Names are vLLM V1's where vLLM has the series (same meaning, same buckets), under
a prefix: `cadence` by default, `vllm` (`--metrics-prefix vllm`) for dashboards,
autoscalers and benchmark tools written for vLLM. Counters are named without `_total`,
which the exposition format adds. Every series is also labelled `model_name`.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIXES = ("cadence", "vllm")


@dataclass(frozen=True)
class Series:
    name: str
    kind: str  # "counter", "gauge" or "histogram"
    doc: str
    labels: tuple[str, ...] = ()  # besides model_name
    buckets: tuple[float, ...] = ()  # histograms; () where they follow max_model_len

    def full_name(self, prefix: str) -> str:
        return f"{prefix}:{self.name}"


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's buckets for token counts)."""
    found: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return tuple(found)
            found.append(float(value))
        scale *= 10


TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
TTFT_BUCKETS += (40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
)
ITL_BUCKETS += (80.0,)
REQUEST_SECONDS_BUCKETS: tuple[float, ...] = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
)
REQUEST_SECONDS_BUCKETS += (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)

# ----- vLLM's series ------------------------------------------------------------------
NUM_REQUESTS_RUNNING = Series("num_requests_running", "gauge", "Sequences in the engines' running batches.")
NUM_REQUESTS_WAITING = Series("num_requests_waiting", "gauge", "Sequences waiting to be scheduled.")
KV_CACHE_USAGE = Series("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = all).")
CACHE_CONFIG_INFO = Series(
    "cache_config_info",
    "gauge",
    "The KV cache's configuration, as labels (always 1).",
    ("block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"),
)
PROMPT_TOKENS = Series("prompt_tokens", "counter", "Prompt tokens of requests that produced their first token.")
GENERATION_TOKENS = Series("generation_tokens", "counter", "Tokens generated.")
REQUEST_SUCCESS = Series(
    "request_success", "counter", "Sequences that ended, by finish reason (abort included).", ("finished_reason",)
)
NUM_PREEMPTIONS = Series("num_preemptions", "counter", "Sequences preempted for lack of KV blocks.")
PREFIX_CACHE_QUERIES = Series(
    "prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache, on first admission."
)
PREFIX_CACHE_HITS = Series("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.")
TTFT = Series(
    "time_to_first_token_seconds", "histogram", "Seconds from arrival to a sequence's first token.", (), TTFT_BUCKETS
)
ITL = Series(
    "inter_token_latency_seconds", "histogram", "Seconds between a sequence's consecutive tokens.", (), ITL_BUCKETS
)
E2E_LATENCY = Series(
    "e2e_request_latency_seconds",
    "histogram",
    "Seconds from arrival to a sequence's end.",
    (),
    REQUEST_SECONDS_BUCKETS,
)
QUEUE_TIME = Series(
    "request_queue_time_seconds",
    "histogram",
    "Seconds a sequence waited in its engine before its first step.",
    (),
    REQUEST_SECONDS_BUCKETS,
)
PREFILL_TIME = Series(
    "request_prefill_time_seconds",
    "histogram",
    "Seconds from a sequence's first step to its first token, in its engine.",
    (),
    REQUEST_SECONDS_BUCKETS,
)
DECODE_TIME = Series(
    "request_decode_time_seconds",
    "histogram",
    "Seconds from a sequence's first token to its last, in its engine.",
    (),
    REQUEST_SECONDS_BUCKETS,
)
INFERENCE_TIME = Series(
    "request_inference_time_seconds",
    "histogram",
    "Seconds from a sequence's first step to its last token, in its engine.",
    (),
    REQUEST_SECONDS_BUCKETS,
)
REQUEST_PROMPT_TOKENS = Series("request_prompt_tokens", "histogram", "Prompt tokens of each finished sequence.")
REQUEST_GENERATION_TOKENS = Series("request_generation_tokens", "histogram", "Tokens each finished sequence generated.")
ITERATION_TOKENS = Series(
    "iteration_tokens_total", "histogram", "Tokens through the model per engine step.", (), ITERATION_TOKENS_BUCKETS
)
REQUEST_PARAMS_N = Series("request_params_n", "histogram", "The n of each admitted request.", (), (1, 2, 5, 10, 20))
REQUEST_PARAMS_MAX_TOKENS = Series(
    "request_params_max_tokens", "histogram", "The max_tokens of each admitted request (its room when unset)."
)

# ----- Cadence's own -------------------------------------------------------------------
STEP_SECONDS = Series(
    "engine_step_seconds",
    "histogram",
    "Seconds per engine step, by kind: prefill (prompt work only), decode, or mixed.",
    ("kind",),
    STEP_SECONDS_BUCKETS,
)
STEP_BATCH_SIZE = Series(
    "engine_step_batch_size", "histogram", "Sequences per engine step, by kind.", ("kind",), BATCH_SIZE_BUCKETS
)
ADMISSION_REJECTIONS = Series(
    "admission_rejections",
    "counter",
    "Requests refused at admission: full (429, too many sequences in flight) or unavailable (503).",
    ("reason",),
)
ENGINE_HEALTHY = Series("engine_healthy", "gauge", "1 while the engines serve, else 0.")
ENGINE_STEPS = Series("engine_steps", "counter", "Engine steps (one forward pass each) run.")
ENGINE_RESTARTS = Series("engine_restarts", "counter", "Times an engine process was started again after dying.")

# ----- prefill/decode disaggregation (only when disaggregated) ------------------------
ENGINE_QUEUE = Series("engine_queue", "gauge", "Sequences per engine and queue.", ("engine", "queue"))
KV_TRANSFER_SECONDS = Series(
    "kv_transfer_seconds",
    "histogram",
    "Seconds from asking a decode engine to load a prompt's KV to hearing it arrived (or not).",
)  # its buckets: server/disaggregation/transfer_stats.py LATENCY_BUCKETS, kept where it is observed
KV_TRANSFERS = Series("kv_transfers", "counter", "Prompt KV loads by outcome.", ("outcome",))
KV_TRANSFER_BYTES = Series("kv_transfer_bytes", "counter", "KV bytes loaded across engines.")
PREFILLS = Series("prefills", "counter", "Prompts by where they were computed.", ("engine_role",))
KV_PREFILL_REROUTES = Series(
    "kv_prefill_reroutes", "counter", "Prompts sent to another prefill engine after theirs died."
)
KV_EXPIRED = Series("kv_expired", "counter", "Waits for KV and holds of KV that ran out of time, all engines.")
RECOMMENDED_PD_RATIO = Series(
    "recommended_prefill_decode_ratio",
    "gauge",
    "Prefill engines per decode engine that would keep both equally busy under the current traffic "
    "(0 until both have worked).",
)

# ----- expert offloading (mixture-of-experts models; exported once a model offloads) ---
EXPERT_CACHE_HITS = Series("expert_cache_hits", "counter", "Routed experts found in fast memory.")
EXPERT_CACHE_MISSES = Series("expert_cache_misses", "counter", "Routed experts loaded from host memory or disk.")
EXPERT_LOAD_BYTES = Series("expert_load_bytes", "counter", "Bytes of expert weights loaded into fast memory.")
EXPERT_STALL_SECONDS = Series(
    "expert_stall_seconds", "counter", "Seconds engine steps waited for expert weights to arrive."
)
EXPERT_PREFETCH_LOADS = Series("expert_prefetch_loads", "counter", "Experts loaded ahead of their layer.")
EXPERT_PREFETCH_PREDICTED = Series(
    "expert_prefetch_predicted", "counter", "Experts predicted for a layer before it routed (precision's denominator)."
)
EXPERT_PREFETCH_CORRECT = Series("expert_prefetch_correct", "counter", "Predicted experts the layer then routed.")
EXPERT_PREFETCH_ROUTED = Series(
    "expert_prefetch_routed", "counter", "Experts routed in layers that had a prediction (recall's denominator)."
)
EXPERT_LAYER_STEPS = Series(
    "expert_layer_steps",
    "counter",
    "MoE layer steps by how their experts ran: through the cache, or streamed through two buffers.",
    ("mode",),
)
EXPERT_CPU_COMPUTED = Series(
    "expert_cpu_computed", "counter", "Cold experts run on the CPU instead of copied to the GPU."
)

"""The EPP's metrics under the Gateway API Inference Extension's names.

GAIE's dashboards and alerts read its EPP's metrics (``pkg/epp/metrics/metrics.go`` in
kubernetes-sigs/gateway-api-inference-extension, v1; the names its e2e test checks).
This EPP exports those it can know, with the same names, labels and buckets, in the same
registry as its ``sessionfleet_*`` metrics:

=====================================================================  =========  ==================
name                                                                   type       labels
=====================================================================  =========  ==================
``inference_objective_request_total``                                  counter    ``model_name``,
                                                                                  ``target_model_name``
``inference_objective_request_error_total``                            counter    the same,
                                                                                  ``error_code``
``inference_objective_request_duration_seconds``                       histogram  the same two
``inference_objective_request_sizes``                                  histogram  the same two
``inference_objective_response_sizes``                                 histogram  the same two
``inference_objective_input_tokens``                                   histogram  the same two
``inference_objective_output_tokens``                                  histogram  the same two
``inference_objective_prompt_cached_tokens``                           histogram  the same two
``inference_objective_normalized_time_per_output_token_seconds``       histogram  the same two
``inference_objective_running_requests``                               gauge      ``model_name``
``inference_pool_average_kv_cache_utilization``                        gauge      ``name``
``inference_pool_ready_pods``                                          gauge      ``name``
``inference_extension_info``                                           gauge      ``commit``,
                                                                                  ``build_ref``
=====================================================================  =========  ==================

``model_name`` is the model the request named ("" when none), ``target_model_name`` the
one it was routed by (docs/epp.md, "Models"). ``name`` is the InferencePool's
(``--pool-name``; "" without one). Not exported: the queue sizes
(``inference_pool_average_queue_size``, ``…per_pod_queue_size``) and the scheduler's and
flow control's own metrics, which this EPP has no counterpart for (it reads no engine
metrics; it places by sessions held, not by queues). Error codes follow GAIE's:
``BadRequest`` (the EPP's 4xx), ``InferencePoolResourceExhausted`` (429),
``ServiceUnavailable`` (503), ``ModelServerError`` (the engine's 5xx).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sessionfleet._version import __version__
from sessionfleet.engines.vllm import Usage
from sessionfleet.fronts.bindings import BindingTable, WorkerView

MODEL_LABELS: Final = ("model_name", "target_model_name")
MAX_LABEL_CHARS: Final = 128
"""Model names from request bodies are cut to this length: a label stays small."""

# GAIE's buckets (pkg/epp/metrics/metrics.go).
LATENCY_BUCKETS: Final = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6,
    8, 10, 15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200,
    1800, 2700, 3600,
)  # fmt: skip
REQUEST_SIZE_BUCKETS: Final = (
    64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
    131072, 262144, 524288, 1048576, 2097152, 4194304, 8388608,
    16777216, 33554432, 67108864, 134217728, 268435456, 536870912, 1073741824,
)  # fmt: skip
RESPONSE_SIZE_BUCKETS: Final = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536,
)  # fmt: skip
INPUT_TOKEN_BUCKETS: Final = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536,
    131072, 262144, 524288, 1048576,
)  # fmt: skip
OUTPUT_TOKEN_BUCKETS: Final = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
NTPOT_BUCKETS: Final = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def error_code(status: int) -> str:
    """Return GAIE's error code for an answer of this HTTP status."""
    if status == 429:
        return "InferencePoolResourceExhausted"
    if status == 503:
        return "ServiceUnavailable"
    if status >= 500:
        return "ModelServerError"
    return "BadRequest"


def _label(model: str | None) -> str:
    return (model or "")[:MAX_LABEL_CHARS]


class GaieMetrics:
    """GAIE's EPP metrics, in ``registry``; see the module."""

    def __init__(
        self,
        registry: CollectorRegistry,
        table: BindingTable,
        pool_name: str,
        in_pool: Callable[[WorkerView], bool],
    ) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, MODEL_LABELS, buckets=buckets, registry=registry)

        self.requests = Counter(
            "inference_objective_request",
            "Counter of inference objective requests broken out for each model and target model.",
            MODEL_LABELS,
            registry=registry,
        )
        self.errors = Counter(
            "inference_objective_request_error",
            "Counter of inference objective requests errors broken out for each model and "
            "target model.",
            [*MODEL_LABELS, "error_code"],
            registry=registry,
        )
        self.duration = histogram(
            "inference_objective_request_duration_seconds",
            "Inference objective response latency distribution in seconds.",
            LATENCY_BUCKETS,
        )
        self.request_sizes = histogram(
            "inference_objective_request_sizes",
            "Inference objective requests size distribution in bytes.",
            REQUEST_SIZE_BUCKETS,
        )
        self.response_sizes = histogram(
            "inference_objective_response_sizes",
            "Inference objective responses size distribution in bytes.",
            RESPONSE_SIZE_BUCKETS,
        )
        self.input_tokens = histogram(
            "inference_objective_input_tokens",
            "Inference objective input token count distribution for requests in each model.",
            INPUT_TOKEN_BUCKETS,
        )
        self.output_tokens = histogram(
            "inference_objective_output_tokens",
            "Inference objective output token count distribution for requests in each model.",
            OUTPUT_TOKEN_BUCKETS,
        )
        self.cached_tokens = histogram(
            "inference_objective_prompt_cached_tokens",
            "Inference objective prompt cached token count distribution for requests.",
            INPUT_TOKEN_BUCKETS,
        )
        self.ntpot = histogram(
            "inference_objective_normalized_time_per_output_token_seconds",
            "Inference objective latency divided by number of output tokens in seconds.",
            NTPOT_BUCKETS,
        )
        self.running = Gauge(
            "inference_objective_running_requests",
            "Inference objective number of running requests in each model.",
            ["model_name"],
            registry=registry,
        )
        info = Gauge(
            "inference_extension_info",
            "General information of the current build of Inference Extension.",
            ["commit", "build_ref"],
            registry=registry,
        )
        info.labels(commit="", build_ref=f"sessionfleet-{__version__}").set(1)
        registry.register(_PoolCollector(table, pool_name, in_pool))

    def started(self, model: str | None, target: str | None) -> None:
        """Count a request routed to a worker (its response is yet to come)."""
        self.requests.labels(_label(model), _label(target)).inc()
        self.running.labels(_label(model)).inc()

    def refused(self, model: str | None, target: str | None, status: int) -> None:
        """Count a request the EPP answered itself."""
        self.requests.labels(_label(model), _label(target)).inc()
        self.errors.labels(_label(model), _label(target), error_code(status)).inc()

    def finished(
        self,
        model: str | None,
        target: str | None,
        *,
        status: int | None,
        seconds: float,
        request_bytes: int,
        response_bytes: int,
        usage: Usage | None,
        completed: bool,
    ) -> None:
        """Record a routed request's end (``completed``: its response reached its end)."""
        labels = (_label(model), _label(target))
        self.running.labels(labels[0]).dec()
        if status is not None and status >= 500:
            self.errors.labels(*labels, error_code(status)).inc()
        if not completed or status != 200:
            return
        self.duration.labels(*labels).observe(seconds)
        self.request_sizes.labels(*labels).observe(request_bytes)
        self.response_sizes.labels(*labels).observe(response_bytes)
        if usage is not None:
            self.input_tokens.labels(*labels).observe(usage.prompt_tokens)
            self.output_tokens.labels(*labels).observe(usage.completion_tokens)
            if usage.cached_tokens is not None:
                self.cached_tokens.labels(*labels).observe(usage.cached_tokens)
            if usage.completion_tokens > 0:
                self.ntpot.labels(*labels).observe(seconds / usage.completion_tokens)


class _PoolCollector(Collector):
    """The pool gauges, read from the binding table at scrape time."""

    def __init__(
        self, table: BindingTable, pool_name: str, in_pool: Callable[[WorkerView], bool]
    ) -> None:
        self._table = table
        self._name = pool_name
        self._in_pool = in_pool

    def collect(self) -> Iterator[Metric]:
        ready = [w for w in self._table.workers.values() if w.ready and self._in_pool(w)]
        pods = GaugeMetricFamily(
            "inference_pool_ready_pods",
            "The number of ready pods in the inference server pool.",
            labels=["name"],
        )
        pods.add_metric([self._name], len(ready))
        yield pods
        kv = GaugeMetricFamily(
            "inference_pool_average_kv_cache_utilization",
            "The average kv cache utilization for an inference server pool.",
            labels=["name"],
        )
        kv.add_metric([self._name], sum(w.kv_usage for w in ready) / len(ready) if ready else 0.0)
        yield kv

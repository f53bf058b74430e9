"""The server's metrics in Prometheus' text format (`GET /metrics`): requests, tokens, the queue, the KV pool and
its prefix cache, time to first token and inter-token latency.

Written by the engine's thread, read by the HTTP thread: plain numbers, each updated by one assignment.
"""

from __future__ import annotations

import bisect

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "tensorpar_serve"


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets, self.counts = tuple(buckets), [0] * (len(buckets) + 1)
        self.total, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.total}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    def __init__(self):
        self.requests = {"completed": 0, "cancelled": 0, "rejected": 0}
        self.prompt_tokens = self.generation_tokens = self.steps = self.step_tokens = 0
        self.step_seconds = 0.0
        self.ttft, self.itl = Histogram(), Histogram()

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens

    def rejected(self) -> None:
        self.requests["rejected"] += 1

    def finished(self, how: str) -> None:
        self.requests[how] += 1

    def token(self, seconds: float, first: bool) -> None:
        self.generation_tokens += 1
        (self.ttft if first else self.itl).observe(seconds)

    def step(self, seconds: float, tokens: int) -> None:
        self.steps += 1
        self.step_tokens += tokens
        self.step_seconds += seconds

    def render(self, scheduler) -> str:
        """The metrics as Prometheus text; the queue and the pool as `scheduler` holds them now."""
        p = PREFIX
        waiting, running = len(scheduler.waiting), len(scheduler.running)
        used, total = scheduler.allocator.used_blocks, scheduler.allocator.num_blocks
        lines = [f"# HELP {p}_requests_total Requests by outcome.", f"# TYPE {p}_requests_total counter"]
        lines += [f'{p}_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
        for name, kind, value, help_text in (
            ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of admitted requests."),
            ("generation_tokens_total", "counter", self.generation_tokens, "Tokens generated."),
            ("steps_total", "counter", self.steps, "Model steps run (each on every rank)."),
            ("step_tokens_total", "counter", self.step_tokens, "Tokens fed to the model over all steps."),
            ("step_seconds_total", "counter", self.step_seconds, "Seconds spent in model steps."),
            ("preemptions_total", "counter", scheduler.preemptions, "Sequences preempted (recomputed) for KV blocks."),
            ("rope_recomputes_total", "counter", scheduler.rope_recomputes,
             "Sequences recomputed on passing longrope's original length."),
            ("queue_length", "gauge", waiting, "Sequences waiting to join the batch."),
            ("running_sequences", "gauge", running, "Sequences in the running batch."),
            ("kv_blocks_used", "gauge", used, "KV pool blocks held by sequences."),
            ("kv_blocks_total", "gauge", total, "KV pool blocks."),
            ("kv_blocks_cached", "gauge", scheduler.allocator.cached_blocks,
             "KV pool blocks holding a cached prefix, held by sequences or free."),
            ("prefix_cache_queries_total", "counter", scheduler.prefix_queries,
             "Tokens of starting sequences looked up in the prefix cache."),
            ("prefix_cache_hits_total", "counter", scheduler.prefix_hits,
             "Tokens of starting sequences found in the prefix cache (not computed)."),
        ):
            lines += [f"# HELP {p}_{name} {help_text}", f"# TYPE {p}_{name} {kind}", f"{p}_{name} {value}"]
        lines += self.ttft.lines(f"{p}_time_to_first_token_seconds", "Arrival to first generated token.")
        lines += self.itl.lines(f"{p}_inter_token_latency_seconds", "Between consecutive tokens of a sequence.")
        return "\n".join(lines) + "\n"

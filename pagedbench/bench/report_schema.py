"""The reports' CSV schema: every kind of row (serving runs, requests, KV timelines, kernels,
check cases, bench-serve rates) and its columns, in order."""

import json

from pagedbench.bench.metrics import LATENCIES, STATISTICS
from pagedbench.bench.serve_client import PERCENTILES
from pagedbench.config import EngineConfig
from pagedbench.engine.stats import TIME_COLUMNS

# Columns of older CSVs under their current names (a backend's prepare() is its plan() since 2026-11).
RENAMED_COLUMNS = {
    "time_backend_prepare_s": "time_backend_plan_s",
    "prepare_min_ms": "plan_min_ms",
    "prepare_median_ms": "plan_median_ms",
}
# Every engine setting by its EngineConfig name, but those a row says otherwise: backend, device and
# dtype (ENVIRONMENT's, resolved) and speculative_config (the `speculative` label).
SETTING_COLUMNS = [n for n in EngineConfig.names() if n not in ("backend", "device", "dtype", "speculative_config")]


def setting_columns(config: EngineConfig) -> dict:
    """A row's engine settings (SETTING_COLUMNS), a JSON setting as its text."""
    values = {name: getattr(config, name) for name in SETTING_COLUMNS}
    return {name: json.dumps(v) if isinstance(v, dict) else v for name, v in values.items()}


REPRO = "repro"  # the command that measures the row again (bench/repro.py); CSV only, never in a table
ENVIRONMENT = [
    "kind",
    "command",
    "timestamp",
    "git_sha",
    "torch_version",
    "triton_version",  # the attention libraries' versions as installed ("" where absent)
    "flash_attn_version",
    "flashinfer_version",
    "cuda_version",  # torch's CUDA and the GPU's driver ("" on a CPU)
    "driver_version",
    "device",
    "device_name",
    "cpu_threads",
    "load_average",
    "dtype",
    "backend",
    "provider",
    "status",
    "reason",
]
SERVING_COLUMNS = ENVIRONMENT + [
    "scenario",
    "scenario_hash",
    "scale",
    "prompts",
    "dataset_name",
    "dataset_path",
    *SETTING_COLUMNS,
    "speculative",
    "structured",
    "arrival",
    "request_rate",
    "temperature",
    "n",
    "repeat",
    "num_requests",
    "total_input_tokens",
    "total_output_tokens",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *[f"{stat}_{name}_ms" for name in LATENCIES for stat in STATISTICS],
    "steps",
    "preemptions",
    "peak_kv_blocks",
    "peak_kv_utilization",
    "peak_running_seqs",
    "world_size",
    "mean_steps_in_flight",
    "replica_requests",
    "replica_output_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "state_snapshots",
    "state_snapshot_bytes",
    "peak_shared_blocks",
    "block_copies",
    "cascade_steps",  # steps of the run that cascaded (backends/cascade.py; cascade_attention: the setting asked)
    "cascade_share",  # the share of the decode rows' KV reads that cascade's prefix passes served
    "mean_kv_utilization",
    "mean_wasted_slots",
    "peak_wasted_slots",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_acceptance_rate",
    "spec_mean_acceptance_length",
    "spec_acceptance_per_position",
    *TIME_COLUMNS,
    "time_grammar_fill_s",
    "time_grammar_apply_s",
    "grammar_share",
    "grammar_rows",
    "time_grammar_compile_s",
    "time_device_s",
    "time_attention_s",
    "attention_share",
    "num_experts",
    "experts_per_token",
    "moe_kernel",
    "time_moe_s",
    "moe_share",
    "time_linear_attention_s",
    "linear_attention_share",  # linear_attention_kernel (a setting): empty for models without DeltaNet layers
    "time_indexer_s",
    "indexer_share",
    "engine_overhead_share",
    "busy_share",  # the device's time over the run's wall time (CUDA; empty where the device is not timed)
    "time_backend_compile_s",
    "time_model_compile_s",
    "kernels_per_step",
    "kernels_per_layer",
    "cuda_graphs",
    "throughput_vs_best",
    "output_throughput_min",
    "output_throughput_max",
    "output_throughput_ci_low",
    "output_throughput_ci_high",
    "ranking",
    "identical_token_share",
    "identical_alone",  # compare --alone-check: share of K requests whose greedy tokens alone equal their batched run's
    REPRO,
]
REQUEST_COLUMNS = [
    "kind",
    "command",
    "device_name",
    "dtype",
    "model",
    "backend",
    "provider",
    "scenario",
    "scenario_hash",
    "scale",
    "repeat",
    "request",
    "input_len",
    "output_len",
    "ttft_ms",
    "tpot_ms",
    "e2el_ms",
]
KV_COLUMNS = REQUEST_COLUMNS[: REQUEST_COLUMNS.index("repeat") + 1] + [
    "num_blocks",
    "step",
    "time_s",
    "used_blocks",
    "kv_utilization",
    "wasted_slots",
]
KERNEL_COLUMNS = ENVIRONMENT + [
    "variant",  # plain, window-1024, softcap-50, sinks (kernels.VARIANTS)
    "linear_attention_kernel",  # variant gdn: the gated delta rule's kernel (torch, fla)
    "phase",
    "query_len",
    "kv_cache_dtype",
    "batch_size",
    "context_len",
    "prefix_len",  # variant cascade: the group's shared prefix (tokens), then each sequence's own suffix
    "suffix_len",
    "cascade",  # variant cascade: off (flat) or on (the prefix read once per group)
    "cascade_share",  # the share of the KV rows' reads the prefix pass served
    "block_size",
    "placement",  # where a problem's pages lie (random, contiguous) and the cache's pages (--cache-blocks)
    "cache_blocks",
    "batch_invariant",  # kernels --batch-invariant: each backend in its batch-invariant form
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_query_tokens",
    "kv_bytes",
    "flops",
    "warmup",
    "repeats",
    "plan_min_ms",
    "plan_median_ms",
    "forward_min_ms",
    "forward_median_ms",
    "forward_max_ms",
    "forward_ci_low_ms",
    "forward_ci_high_ms",
    "max_abs_error",  # against the reference backend's output at the point (status mismatch beyond KERNEL_TOLERANCE)
    "max_rel_error",  # that over the largest |reference output|
    "bandwidth_gbps",
    "peak_bandwidth_gbps",
    "peak_bandwidth_source",
    "pct_of_peak_bandwidth",
    "copy_bandwidth_gbps",
    "pct_of_copy_bandwidth",
    "vs_dense",
    "tflops",
    "tile_efficiency",
    "indexer_min_ms",
    "indexer_median_ms",
    "kernel_options",
    "cuda_graphs",
    REPRO,
]
CHECK_COLUMNS = ENVIRONMENT + [
    "case",
    "batch",
    "heads",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "block_size",
    "variant",  # plain, or the AttentionVariant the case runs (window, soft-cap, sinks)
    "linear_attention_kernel",  # the gated DeltaNet cases' kernel (torch, fla)
    "num_seqs",
    "num_query_tokens",
    "max_abs_error",
    "max_rel_error",  # max_abs_error over the largest |oracle output| (as kernels' rows)
    "mean_abs_error",
    "placement_diff",
    "tolerance",
    "top1_agreement",
    REPRO,
]
# `check --determinism`: one row per backend, dtype, phase and variant (bench/check_determinism.py).
DETERMINISM_COLUMNS = ["kind", "command", "timestamp", "git_sha", "torch_version", "device", "device_name"]
DETERMINISM_COLUMNS += ["cpu_threads", "load_average", "provider", "backend", "dtype", "phase", "variant"]
DETERMINISM_COLUMNS += ["deterministic", "max_abs_diff_repeat", "batch_invariant", "max_abs_diff_batch", "broken_by"]
DETERMINISM_COLUMNS += ["claimed_invariant", "reason", "status"]
SERVE_LATENCIES = [f"{stat}_{name}_ms" for name in LATENCIES for stat in PERCENTILES]  # bench-serve's
BENCH_SERVE_COLUMNS = [  # one row per (server, request rate) of `pagedbench bench-serve`
    "kind",
    "timestamp",
    "backend",  # --label, or what the server's /v1/models card says, or its URL
    "base_url",
    "model",
    "scenario",
    "scale",
    "num_prompts",
    "request_rate",
    "max_concurrency",
    "slos_ms",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *SERVE_LATENCIES,
    "goodput",
]
SCHEMAS = {
    "serving": SERVING_COLUMNS,
    "requests": REQUEST_COLUMNS,
    "kv": KV_COLUMNS,
    "kernels": KERNEL_COLUMNS,
    "check": CHECK_COLUMNS,
    "determinism": DETERMINISM_COLUMNS,
    "bench-serve": BENCH_SERVE_COLUMNS,
}

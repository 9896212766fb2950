"""The benchmark harness: scenarios, run/compare, bench-serve, kernels, check, peers, reports, kv-calc."""

"""``clawcomm bench``: nccl-tests-style benchmarks (see clawcomm.bench.cli)."""

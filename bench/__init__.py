"""The benchmarks behind `sluice bench`: each prints figures beside a baseline measured in the
same run. They may import every package but `cli` (whose LocalStack they use)."""

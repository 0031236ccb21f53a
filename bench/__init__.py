"""Benchmarks against peers (onnxruntime), each quoting ratios measured in the same run."""

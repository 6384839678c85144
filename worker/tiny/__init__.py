"""Tiny models and a tokenizer built offline (``rloo demo``, the tests, the benchmarks): made on
disk and loaded through the path real models take, so nothing is downloaded."""

"""The chaos soak (``make soak``; ``python -m benchmarks.soak``): many faults at once against the whole
stack while several projects' clients work, and what must hold afterwards (``checks``)."""

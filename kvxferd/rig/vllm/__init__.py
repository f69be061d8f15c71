"""vLLM on CPU for the tests and benchmarks: a tiny model whose tokens depend on the KV cache
(``tinymodel``), P/D API servers through the proxy against a single instance (``bench``,
``servers``) and the join of their per-process trace stamps (``tracejoin``)."""

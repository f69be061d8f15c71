"""The rig: what proves and measures kvxferd, apart from the product.

``verify`` (the coordinate oracle, in-process and daemon clusters, GPU caches, namespace hosts),
``bench`` (every benchmark suite), ``soak`` (the chaos soak), ``demo`` (the main job) and ``vllm``
(a KV-sensitive tiny model, vLLM API-server benchmarks and their trace join). The product never
imports it (tests/test_purity.py); the CLI imports the part a command needs, when it runs.
"""

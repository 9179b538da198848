"""Model-quality harness for topology-aware KV selection (``//benchmark:topology_kv_quality``).

A real decoder (SmolLM2-135M-Instruct by default, any GGUF decoder transformers loads)
runs over real text (the six Austen novels of Debian's ``r-cran-janeaustenr``) with
sparse attention inside its own forward: every full-attention layer attends, for each
query token, only to the ``W`` positions a *selector* picks. Perplexity and per-layer
attention metrics compare each selector with dense attention at the same budget, and a
gate turns them into PASS/FAIL per policy mode.

Modules, one concern each:

    paths             repository root, data folder, ``bazel run`` path resolution
    text              Austen text (Debian package -> cached plain text) or any UTF-8 file -> token windows
    model             GGUF discovery, offline loading, full-attention layer detection
    index_rows        the engine's top-k row convention: build, check, turn into masks
    layer             one layer's attention inputs and the chunked attention maths
    synthetic         random layer inputs for tests (no model)
    selector_base     selector contract and settings, chunked top-W rows, the proxy indexer
                      (fp8 through the engine's ``indexer_torch_ops.fp8_e4m3_round_trip``)
    policy_selectors  the real ``apply_topology_kv_policy`` on the learned rows
    failure_modes     the proxy indexer degraded (noisy / nosink / stale)
    selectors         oracle / learned / locality / random / all, and the by-name registry
    sparse_attention  the transformers attention-interface hook and per-forward plan
    metrics           chunked perplexity and per-layer metric accumulators
    intervals         paired chunk-bootstrap intervals of perplexity ratios
    probe             the copy probe: random segments repeated at a distance, copy accuracy
    runner            the grid: dense forward, then one forward per (selector, budget)
    gate              PASS/FAIL per policy mode from the grid's numbers
    raised_gate       the stricter gate over merge modes and failure modes (``--raised-gate``)
    report            markdown table, JSON, PNG plots
    compare           before/after tables of runs of the same grid
    cli               flags, validation, ``main``

Selector modules import in one direction: ``selector_base`` <- ``policy_selectors``,
``failure_modes`` <- ``selectors`` (the registry) <- ``runner`` <- ``cli``.

Shape vocabulary (shared with the rest of the project): ``T`` query tokens (rows),
``L`` key length, ``W`` budget (top-k width), ``H`` query heads, ``Hkv`` key/value
heads, ``D`` head dim, ``N`` blocks.
"""

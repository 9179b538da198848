"""End-to-end decode shaped like serving: batches of requests through the ``Indexer``.

A real GGUF decoder (SmolLM2-135M-Instruct by default) prefills one window of Austen
prose densely (in chunks) per prompt (``--prompts``), then decodes a batch of ``B`` requests of different context
lengths per variant over a paged KV pool, every variant from the same prefilled state,
on the CPU or a CUDA device (``--device``). The command line is
``benchmark/topology_kv_decode_e2e.py``.

Modules, one concern each (imports run downwards):

    clock      the phase timers' clock: perf_counter, synchronized on CUDA
    layout     the paged pools and block tables: shared prefill blocks, private blocks per variant
    indexers   the proxy indexer and its presets (dsa-ratio, model); the variants' ``Indexer``
    memory     a step's transient peak memory (host, or the CUDA allocator's); host page faults per step
    attention  the registered attention hook and its per-forward ``StepPlan``
    paired     the balanced variant order per step; intervals of the paired step ratio and KL difference
               (the KL bootstrap drawn within each prompt)
    prompts    the prompts' offsets in the novel; one row pooled over the prompts
    report     the targets, markdown tables (each variant paired with `learned`), the plots, merged runs
    decode     prefill, the batch's layout for every variant, interleaved decode steps
    runner     one run over (context, batch): summary rows with every measured field
"""

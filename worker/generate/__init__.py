"""The generate role: lease a version, sample, score, write one rollout, submit it.

Modules:
    job                   one generate task as a plain function: lease, fetch adapter, sample, score, write, submit
    evaluate              one evaluate task ([eval]): lease the version, sample and score held-out prompts, post sums
    adapters              the local LRU cache of verified adapter versions, and the background thread that
                          loads each new version as soon as it is published
    backend               the generation backend interface and its result types; the exact prompt text fed to
                          the model (chat template) and how to tokenize it
    factory               picks a worker's backend (transformers or vLLM)
    transformers_backend  the transformers + PEFT backend (CPU, or CUDA)
    vllm_backend          the vLLM backend (in its own environment)
    settings              the generate side's settings (backend override, vLLM engine args, prefetch)
"""

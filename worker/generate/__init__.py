"""The generate role: lease a version, sample, score, write one rollout, submit it.

Modules:
    task_context          what a generate or eval task works with (the worker's parts for its run), and the
                          set-up both make: the lease renewed, the leased version's adapter fetched and loaded
    job                   one generate task as an object, its phases in order: lease, prompts, sample (or
                          converse), score, write, submit
    evals                 one eval task ([eval]) as an object: lease the version, sample and score held-out
                          prompts, post sums; the unbiased pass@k estimator and which k are reported
    adapter_cache         the local LRU cache of verified adapter versions (at most max_staleness + 2)
    inflight              in-flight updates: the prefetcher's verified versions offered to a sampling task, which
                          moves its sequences onto the newest between two decode steps
    partial               partial rollouts: an interrupted task's unfinished sequences saved to the bucket, and
                          continued from their token ids by the next task of the same prompt
    backend               the generation backend interface and its result types; the exact prompt text fed to
                          the model (chat template) and how to tokenize it
    factory               picks a worker's backend (transformers or vLLM)
    transformers_backend  the transformers + PEFT backend (CPU, or CUDA)
    vllm_backend          the vLLM backend (in its own environment)
    settings              the generate side's settings (backend override, vLLM engine args, prefetch)
    agent                 agent rollouts: conversations advanced turn by turn from token ids, tool calls parsed
                          and answered, the mask of the model's tokens, budgets; the template checks; a tool
                          process per group of a task, so a dead one costs only its groups
    toy_agent             the toy agent task's environment (a digit hidden behind a reveal() tool)
    calculator            a built-in agent tool: calculate(expression), safe arithmetic parsed with ast
    tool_process          agent tools and environments (TRL's contract) in a child process: schemas, pooled
                          environment instances, timeouts and crashes as failed tool answers; siblings that
                          share one probe
"""

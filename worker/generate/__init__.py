"""The generate role: lease a version, sample, score, write one rollout, submit it.

Modules:
    job                   one generate task as a plain function: lease (and its renewer), fetch the adapter,
                          sample, score, write, submit; the local LRU cache of verified adapter versions
    evaluate              one evaluate task ([eval]): lease the version, sample and score held-out prompts, post
                          sums; the unbiased pass@k estimator and which k are reported
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

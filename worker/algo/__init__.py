"""Pure functions and formats of GRPO: no I/O, no Celery, no Redis, no bucket.

Modules:
    grpo          the GRPO math: group advantages, the clipped loss of each loss type, diagnostics
    pass_at_k     the unbiased pass@k estimator of evaluations, and which k are reported
    math_scoring  math-verify in a helper process, so its SIGALRM timeouts leave the worker's signals alone
    rewards       reward registry: repeat_digit, exact_match, format, math_verify, `module:function`
    rollout       the rollout object format (safetensors + JSON header)
"""

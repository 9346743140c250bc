"""Pure functions and formats of GRPO: no I/O, no Celery, no Redis, no bucket.

Modules:
    grpo     the GRPO math: group advantages, the clipped loss of each loss type, diagnostics
    rewards  reward registry: repeat_digit, exact_match, format, math_verify, `module:function`
    rollout  the rollout object format (safetensors + JSON header)
"""

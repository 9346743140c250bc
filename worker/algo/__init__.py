"""GRPO's math and formats: no broker, Redis or bucket code (an import-linter contract), and no I/O but one
helper process (`math_scoring`, so that math-verify's SIGALRM timeouts leave the worker's signals alone).

Modules:
    advantages    advantages of a generate task's completions: scale_rewards and multi-objective aggregation
    grpo          the policy loss of every loss type and its options (TRL's menu), diagnostics
    math_scoring  math-verify in a helper process, so its SIGALRM timeouts leave the worker's signals alone
    rewards       reward registry: repeat_digit, exact_match, format, math_verify, `module:function`
    rollout       the rollout object format (safetensors + JSON header)
"""

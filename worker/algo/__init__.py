"""GRPO's math and formats: no broker, Redis or bucket code (an import-linter contract), and no I/O but one
helper process (`math_scoring`, so that math-verify's SIGALRM timeouts leave the worker's signals alone).

Modules:
    grpo          the GRPO math: group advantages, the clipped loss of each loss type, diagnostics
    math_scoring  math-verify in a helper process, so its SIGALRM timeouts leave the worker's signals alone
    rewards       reward registry: repeat_digit, exact_match, format, math_verify, `module:function`
    rollout       the rollout object format (safetensors + JSON header)
"""

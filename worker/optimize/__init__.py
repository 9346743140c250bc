"""The optimize role: one optimizer step over a claimed batch, published as the next version.

Modules:
    job            one optimize task: load state, fetch rollouts, rescore, step, upload, publish
    trainer        rescoring, micro-batched AdamW steps, LR schedule, version files
    trainer_state  adapter and trainer state to and from safetensors + JSON
"""

"""The optimize role: one optimizer step over a claimed batch, published as the next version.

Modules:
    job      one optimize task: load state, fetch rollouts, rescore, step, upload, publish; its step record and
             why a step could not be trained, as reported; the step's versions in the bucket (the base, earlier
             uploads, pinned to the proxy's sha) and the bytes held to put a corrupted object back
    trainer  train samples from rollouts, split into updates and packed into micro-batches; micro-batched AdamW
             steps, LR schedule, version files; trainer state to and from safetensors
    rescore  rescoring under the claimed versions, ratios, flagging a worker's wrong weights
"""

"""The optimize role: one optimizer step over a claimed batch, published as the next version.

Modules:
    job            one optimize task: load state, fetch rollouts, rescore, step, upload, publish; its step
                   record and why a step could not be trained, as reported
    trainer        micro-batched AdamW steps, LR schedule, version files; trainer state to and from safetensors
    batch          train samples from rollouts, split into updates, packed into micro-batches
    rescore        rescoring under the claimed versions, ratios, flagging a worker's wrong weights
    version_io     a step's versions in the bucket: load the base, earlier uploads, pinned to the proxy's sha;
                   the bytes of the last version uploaded or loaded, to put a corrupted object back
"""

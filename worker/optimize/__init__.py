"""The optimize role: one optimizer step over a claimed batch, published as the next version.

Modules:
    job      the Optimizer: one optimize task per call, its phases as methods (load state, fetch rollouts,
             rescore, update, upload, publish), the held version and rescoring weights it keeps; the step record and
             why a step could not be trained, as reported; the step's versions in the bucket (the base, earlier
             uploads, pinned to the proxy's sha) and the bytes held to put a corrupted object back
    trainer  micro-batched AdamW updates over a batch (every [loss] option, the generator-trainer correction),
             LR schedule, rescoring (under another version's LoRA too), version files
    trainer_state  a version's files: the PEFT adapter, optimizer moments and RNG to and from safetensors + JSON
    batch    train samples from rollouts, split into updates; micro-batch plans (padding-free or padded), their
             tensors, and how micro-batches are dealt out to ranks
    ranks    an optimize worker over N local GPUs: joining the ranks, FSDP2 sharding of the frozen base, the
             leader's calls run by every rank, sums and gathers across ranks
    rescore  rescoring under the claimed versions (every sequence a correction weighs), the recent versions'
             weights it reuses, ratios, flagging a worker's wrong weights
"""

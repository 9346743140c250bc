"""The model side: a base model wrapped with LoRA, and the tiny offline model for tests and the demo.

Modules:
    policy      load a base model, wrap it with plain LoRA, prepare it for training (checkpointing, compile)
    attention   exact attention inside each sequence of a packed row, without a (T, T) mask (padding-free
                training where flash-attention's varlen kernel is not in use)
    tokenizer   a model's tokenizer loaded as it was saved (the one loader workers, checks and backends use)
    tiny_model  the tiny random-init model and its tokenizer, built offline
    reward_models  sequence-classification reward models as rewards: checked at `run create`, loaded once per
                generate worker, scoring a task's completions in batches
"""

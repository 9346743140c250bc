"""Unit tests of the workers' pure parts: GRPO math, rewards, generation, the trainer on the tiny model."""

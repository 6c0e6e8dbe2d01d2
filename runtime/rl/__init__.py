"""RL side of the runtime: tasks and datasets, rewards, tokenizer, GRPO, trainer and drafter training."""

"""specrl runtime: RLJob API, speculative rollout engine, GRPO training, weight sync, local mode."""

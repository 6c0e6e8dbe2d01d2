"""Reward functions importable by rollout actors in the integration tests (added to their PYTHONPATH)."""


def raising(prompt: str, completion: str, answer: str) -> float:
    raise RuntimeError("this reward function is broken on purpose")


def length_reward(prompt: str, completion: str, answer: str) -> float:
    """Dense signal for micro models that cannot solve the task yet: shorter answers score higher."""
    return 1.0 / (1.0 + len(completion))


def starts_with_digit(prompt: str, completion: str, answer: str) -> float:
    """A behaviour the near-random micro policy shows about half the time: GRPO must make it the rule."""
    return 1.0 if completion[:1].isdigit() else 0.0


def slow_on_marker(prompt: str, completion: str, answer: str) -> float:
    """A reward that hangs (longer than the test's reward timeout) on prompts containing SLOW."""
    if "SLOW" in prompt:
        import time

        time.sleep(5.0)
    return length_reward(prompt, completion, answer)

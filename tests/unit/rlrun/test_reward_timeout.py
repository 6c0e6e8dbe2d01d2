"""reward.timeoutSeconds (issue 13.14): a reward call that outlives the timeout scores 0 and is counted."""

from __future__ import annotations

import threading
import time

from specrl.runtime.rl.reward import SafeReward


def test_a_hung_reward_scores_zero_within_the_timeout_and_is_counted():
    release = threading.Event()

    def reward(prompt: str, completion: str, answer: str) -> float:
        if prompt == "hang":
            release.wait(30)
        return 1.0

    safe = SafeReward(reward, timeout_s=0.2)
    try:
        t0 = time.perf_counter()
        assert safe("hang", "", "") == 0.0
        assert time.perf_counter() - t0 < 5
        assert safe("fine", "", "") == 1.0
        assert (safe.timeouts, safe.errors, safe.calls) == (1, 1, 2)
        assert safe.last_error == "TimeoutError: took longer than 0.2s"
    finally:
        release.set()


def test_a_raising_reward_under_a_timeout_is_an_error_not_a_timeout():
    def reward(prompt: str, completion: str, answer: str) -> float:
        raise KeyError("boom")

    safe = SafeReward(reward, timeout_s=5)
    assert safe("p", "c", "a") == 0.0
    assert (safe.timeouts, safe.errors) == (0, 1)

import pytest
from specrl.runtime.rl.reward import RewardLoadError, SafeReward, exact_match, load_reward

PLUGIN = '''
def length_bonus(prompt, completion, answer):
    return 0.5 if answer in completion else 0.0

def broken(prompt, completion, answer):
    raise RuntimeError("user bug")

def nan(prompt, completion, answer):
    return float("nan")

NOT_CALLABLE = 3
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_plugin"


def test_builtin_exact_match():
    assert load_reward("builtin:exact_match") is exact_match
    assert load_reward("exact_match") is exact_match
    assert exact_match("Q:1+2=?", "3;A:3", "3") == 1.0
    assert exact_match("Q:1+2=?", "3;A:4", "3") == 0.0


def test_plugin_by_module_function(plugin):
    fn = load_reward(f"{plugin}:length_bonus")
    assert fn("p", "the answer is 42", "42") == 0.5


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("builtin:nope", "unknown builtin"),
    ("justaname", "not of the form 'module:function'"),
    ("", "empty"),
])
def test_unloadable_specs(spec, message):
    with pytest.raises(RewardLoadError, match=message):
        load_reward(spec)


def test_plugin_missing_attribute_or_not_callable(plugin):
    with pytest.raises(RewardLoadError, match="no attribute 'missing'"):
        load_reward(f"{plugin}:missing")
    with pytest.raises(RewardLoadError, match="not callable"):
        load_reward(f"{plugin}:NOT_CALLABLE")


def test_raising_or_non_numeric_reward_scores_zero_and_is_counted(plugin):
    seen: list[BaseException | None] = []
    safe = SafeReward.from_spec(f"{plugin}:broken", on_error=seen.append)
    assert safe.batch(["p", "p"], ["c", "c"], ["a", "a"]) == [0.0, 0.0]
    assert safe.errors == 2 and safe.calls == 2 and "user bug" in str(safe.last_error)
    assert len(seen) == 2 and isinstance(seen[0], RuntimeError)
    nan = SafeReward.from_spec(f"{plugin}:nan")
    assert nan("p", "c", "a") == 0.0 and nan.errors == 1
    good = SafeReward.from_spec("builtin:exact_match")
    assert good("p", "A:3", "3") == 1.0 and good.errors == 0
    with pytest.raises(ValueError, match="same length"):
        good.batch(["p"], [], [])

"""llmtrain.rewards: "module:function" and "file.py:function" load, and a missing module, file or function is a
ConfigError naming the key and what is missing; functions are called as TRL calls them (prompts,
completions as text or assistant messages, completion_ids, the other columns); one that raises, returns
the wrong number of rewards, a non-number or a non-finite number (NaN, inf, beyond float32) stops with one
line naming it and the prompt index, one past grpo.reward_timeout_s with one naming it and the rank; None
rewards become NaN, and a step where all are None says so; metrics.jsonl writes null, never NaN; the built-ins
exact_answer and format_regex score as documented."""

from __future__ import annotations

import json
import math
import signal
import time

import pytest
import torch

from llmtrain.config import ConfigError
from llmtrain.metrics import MetricsLogger
from llmtrain.rewards import (RewardError, exact_answer, format_regex, load, load_all, none_applied, normalize,
                              reward_timeout, score)


def test_load_module_and_file(tmp_path):
    f = load("llmtrain.rewards:exact_answer")
    assert f.fn is exact_answer and f.name == "exact_answer"
    path = tmp_path / "my_rewards.py"
    path.write_text("def length(prompts, completions, completion_ids, **kw):\n"
                    "    return [float(len(c)) for c in completions]\n")
    g = load(f"{path}:length")
    assert g.name == "length" and g.fn(prompts=["p"], completions=["abc"], completion_ids=[[1]]) == [3.0]


@pytest.mark.parametrize("spec,message", [
    ("no_such_package.rewards:f", "no module named 'no_such_package'"),
    ("llmtrain.rewards:no_such_function", "has no function 'no_such_function'"),
    ("llmtrain.rewards:__doc__", "'__doc__' in llmtrain.rewards is a str, not callable$"),
    ("missing/file.py:f", "no file missing/file.py"),
    ("llmtrain.rewards", "is not 'package.module:function'"),
])
def test_missing_module_file_or_function_is_a_config_error(spec, message):
    with pytest.raises(ConfigError, match=r"grpo\.reward_funcs\[1\]: .*" + message.replace(".", r"\.")):
        load_all(["llmtrain.rewards:format_regex", spec])


def test_broken_file_and_duplicate_names_are_config_errors(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_here\n")
    with pytest.raises(ConfigError, match="importing .*bad.py failed: ModuleNotFoundError"):
        load(f"{bad}:f")
    with pytest.raises(ConfigError, match="two functions named 'exact_answer'"):
        load_all(["llmtrain.rewards:exact_answer", "llmtrain.rewards:exact_answer"])


def call(funcs, completions, prompt_index=None, **columns):
    n = len(completions)
    return score([load(f) if isinstance(f, str) else f for f in funcs], ["p"] * n, completions, [[1, 2]] * n,
                 columns, prompt_index or list(range(n)))


def test_called_as_trl_with_columns_and_none_as_nan(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def seen(prompts, completions, completion_ids, answer, **kw):\n"
                    "    assert kw == {'level': [1, 2]} and completion_ids == [[1, 2], [1, 2]]\n"
                    "    return [None, 0.5]\n")
    got = call([f"{path}:seen", "llmtrain.rewards:exact_answer"], ["#### 3", "4"], answer=["3", "5"], level=[1, 2])
    assert math.isnan(got[0][0]) and got[0][1] == 1.0 and got[1] == [0.5, 0.0]
    chat = [[{"role": "assistant", "content": "so #### 1,000."}]]
    assert call(["llmtrain.rewards:exact_answer"], chat, answer=["1000"]) == [[1.0]]


def test_a_failing_function_stops_with_one_line_naming_it_and_the_prompt(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def picky(prompts, completions, completion_ids, **kw):\n"
                    "    return [1.0 / (len(c) - 3) for c in completions]\n"
                    "def short(prompts, completions, completion_ids, **kw):\n"
                    "    return [1.0]\n"
                    "def words(prompts, completions, completion_ids, **kw):\n"
                    "    return ['yes' for c in completions]\n")
    with pytest.raises(RewardError) as e:
        call([f"{path}:picky"], ["abcd", "abc", "abcde"], prompt_index=[40, 41, 41])
    assert "\n" not in str(e.value) and f"{path}:picky raised ZeroDivisionError" in str(e.value)
    assert "(prompt index 41)" in str(e.value)
    with pytest.raises(RewardError, match=r"short returned 1 rewards for 2 completions \(prompts 7, 8\)"):
        call([f"{path}:short"], ["a", "b"], prompt_index=[7, 8])
    with pytest.raises(RewardError, match="words returned 'yes' for prompt index 5; expected a number or None"):
        call([f"{path}:words"], ["a"], prompt_index=[5])


def test_builtins():
    assert normalize("The answer is #### $1,234.") == "1234" and normalize(" 3.0 ") == "3"
    assert normalize("#### Paris") == normalize("paris")
    assert exact_answer(None, ["#### 12", "12", "13", "x"], None, answer=["12", "12.0", "12", None]) == [
        1.0, 1.0, 0.0, None]
    assert exact_answer(None, ["1"], None) == [None]  # no answer column: not applicable
    assert format_regex(None, ["work... #### 7", "7", "#### 7 and more"], None) == [1.0, 0.0, 0.0]
    assert format_regex(None, ["<a>1</a>", "1"], None, format=[r"<a>\d+</a>", r"<a>\d+</a>"]) == [1.0, 0.0]


@pytest.mark.parametrize("value, shown", [
    ("float('nan')", "nan"), ("float('inf')", "inf"), ("-math.inf", "-inf"), ("1e300", "1e+300"), ("'nan'", "'nan'"),
    ("numpy.float64('nan')", "np.float64(nan)")])
def test_a_non_finite_reward_stops_with_one_line_naming_the_function_and_prompt(tmp_path, value, shown):
    path = tmp_path / "r.py"
    path.write_text(f"import math\nimport numpy\ndef odd(prompts, completions, completion_ids, **kw):\n"
                    f"    return [0.5, {value}, None]\n")
    with pytest.raises(RewardError) as e:
        call([f"{path}:odd"], ["a", "b", "c"], prompt_index=[7, 8, 9])
    assert str(e.value) == (f"reward function {path}:odd returned {shown} for prompt index 8; a reward must be a "
                            "finite number within float32's range (|r| <= 3.403e+38), or None for not applicable")


def test_a_step_where_every_reward_is_none_says_so():
    funcs = [load("llmtrain.rewards:exact_answer"), load("llmtrain.rewards:format_regex")]
    nan = torch.full((4, 2), math.nan)
    assert none_applied(nan, funcs, [3, 5], step=12) == (
        "step 12: every reward function (llmtrain.rewards:exact_answer, llmtrain.rewards:format_regex) returned None "
        "(not applicable) for all 4 completions (prompts 3, 5): no reward, so every advantage is 0 and only the KL "
        "term (grpo.beta) trains")
    nan[2, 1] = 0.0
    assert none_applied(nan, funcs, [3, 5], step=12) is None


def test_a_reward_function_past_reward_timeout_s_stops_naming_it_and_the_rank(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("import time\n"
                    "def slow(prompts, completions, completion_ids, **kw):\n"
                    "    try:\n"
                    "        time.sleep(30)\n"
                    "    except Exception:\n"  # a broad except in the user's code does not swallow the timeout
                    "        pass\n"
                    "    return [1.0] * len(completions)\n"
                    "def fast(prompts, completions, completion_ids, **kw):\n"
                    "    return [1.0] * len(completions)\n")
    funcs = [load(f"{path}:fast"), load(f"{path}:slow")]
    start = time.monotonic()
    with pytest.raises(RewardError) as e:
        score(funcs, ["p", "q"], ["a", "b"], [[1], [2]], {}, [4, 6], timeout_s=0.5, rank=3)
    assert time.monotonic() - start < 5
    assert str(e.value) == f"reward function {path}:slow did not return within grpo.reward_timeout_s=0.5 s on rank 3 " \
                           "(prompts 4, 6)"
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0, 0)
    assert score(funcs[:1], ["p"], ["a"], [[1]], {}, [4], timeout_s=0.5) == [[1.0]]


def test_reward_timeout_s_defaults_to_half_the_collective_timeout_and_stays_below_it():
    assert reward_timeout(None, 600) == 300 and reward_timeout(5, 600) == 5
    with pytest.raises(ConfigError, match=r"^grpo\.reward_timeout_s=600 must be below distributed\.timeout_s=600: "):
        reward_timeout(600, 600)


def test_metrics_jsonl_writes_null_for_non_finite_values(tmp_path):
    log = MetricsLogger(str(tmp_path), True, 2, 0, False)
    log.log({"step": 1, "loss": math.nan, "rewards/f/mean": math.inf, "reward": 0.5, "nested": [-math.inf, 1.0]})
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    record = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
    assert record == {"step": 1, "loss": None, "rewards/f/mean": None, "reward": 0.5, "nested": [None, 1.0]}

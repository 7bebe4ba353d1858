"""The ``code_tests`` reward for real, in bubblewrap sandboxes: the row's tests run against the
final answer's code; the score is the fraction passed (or all-or-nothing); wrong, crashing and
hanging code scores low (a hang is cut by the timeout); a sandbox that cannot run is a typed
failure; a row without usable tests is the row's fault."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from support.sandbox_helpers import usable_bwrap
from rollmesh.rewards.code_tests_reward import CodeSandboxes, code_of, code_tests_reward
from rollmesh.rewards.combined import CombinedReward, load_reward
from rollmesh.rewards.errors import RewardInputError, RewardLoadError, RewardUnavailableError
from rollmesh.rewards.reward_input import RewardInput
from rollmesh.run_config import RewardSpec
from rollmesh.sandbox.bwrap_backend import BwrapBackend

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]

ASSERTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
TEST_CODE = '''
from solution import add

def test_small():
    assert add(1, 2) == 3

def test_negative():
    assert add(-5, 2) == -3

def helper():
    raise AssertionError("not a test")
'''


@pytest.fixture(scope="module")
def sandboxes() -> CodeSandboxes:
    return CodeSandboxes(usable_bwrap())


def answer(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nIt adds."


def score(sandboxes: CodeSandboxes, code: str, tests=ASSERTS, **args) -> float:
    sample = RewardInput(row={"tests": tests}, messages=[], final_text=answer(code))
    return code_tests_reward(sample, sandboxes=sandboxes, **args)


def test_a_right_solution_passes_every_test(sandboxes):
    assert score(sandboxes, "def add(a, b):\n    return a + b") == 1.0


def test_a_partly_wrong_solution_scores_the_fraction_passed_or_nothing(sandboxes):
    wrong_for_negatives = "def add(a, b):\n    return abs(a) + abs(b)"
    assert score(sandboxes, wrong_for_negatives) == pytest.approx(2 / 3)
    assert score(sandboxes, wrong_for_negatives, mode="all") == 0.0


def test_test_functions_in_a_string_are_each_a_test(sandboxes):
    assert score(sandboxes, "def add(a, b):\n    return abs(a + b)", tests=TEST_CODE) == 0.5


def test_rollouts_scoring_at_once_each_get_their_own_sandbox(sandboxes):
    solutions = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return abs(a) + abs(b)",
                 "def add(a, b):\n    return 0"]
    with ThreadPoolExecutor(len(solutions)) as pool:  # rewards run in threads, as the agent loop runs them
        scores = list(pool.map(lambda code: score(sandboxes, code), solutions))
    assert scores == pytest.approx([1.0, 2 / 3, 1 / 3])


def test_a_hanging_test_is_cut_by_the_timeout_and_the_others_still_count(sandboxes):
    hangs_on_negatives = "def add(a, b):\n    while a < 0:\n        pass\n    return a + b"
    assert score(sandboxes, hangs_on_negatives, timeout_s=1.0) == pytest.approx(2 / 3)


def test_code_that_ignores_the_test_timeout_is_killed_and_what_passed_before_counts(sandboxes):
    blocks_the_alarm = ("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                        "def add(a, b):\n    while a < 0:\n        pass\n    return a + b")
    assert score(sandboxes, blocks_the_alarm, timeout_s=0.2) == pytest.approx(1 / 3)


@pytest.mark.parametrize("code", [
    "while True:\n    pass",  # hangs as it loads
    "def add(a, b) return a + b",  # does not compile
    "import os\nprint('x pass 0')\nos._exit(0)",  # leaves before any test, pretending
    "raise SystemExit(0)",
    "hoard = []\nwhile True:\n    hoard.append(bytearray(8 * 1024 * 1024))",  # past its memory: killed or MemoryError
])
def test_a_solution_that_does_not_load_scores_zero(sandboxes, code):
    assert score(sandboxes, code, timeout_s=1.0, memory_mb=64) == 0.0


def test_an_empty_answer_scores_zero_without_a_sandbox():
    sample = RewardInput(row={"tests": ASSERTS}, messages=[], final_text="")
    broken = CodeSandboxes(BwrapBackend(bwrap="/bin/false", use_cgroups=False))
    assert code_tests_reward(sample, sandboxes=broken) == 0.0


def test_a_sandbox_that_cannot_start_is_a_typed_failure():
    broken = CodeSandboxes(BwrapBackend(bwrap="/bin/false", use_cgroups=False, start_timeout_s=30))
    with pytest.raises(RewardUnavailableError, match="the sandbox failed") as failed:
        score(broken, "def add(a, b):\n    return a + b")
    assert failed.value.reward == "code_tests"


@pytest.mark.parametrize(("row", "problem"), [
    ({}, "must be test code"),
    ({"tests": []}, "must be test code"),
    ({"tests": ["assert add(1, 2) = 3"]}, "does not compile"),
])
def test_a_row_without_usable_tests_is_the_rows_fault(row, problem):
    with pytest.raises(RewardInputError, match=problem):
        code_tests_reward(RewardInput(row=row, messages=[], final_text="def add(a, b): pass"))


def test_the_code_is_the_last_python_block_or_the_whole_answer():
    assert code_of("x\n```\nshell\n```\n```python\nA = 1\n```\n```py\nB = 2\n```") == "B = 2\n"
    assert code_of("```\nC = 3\n```") == "C = 3\n"
    assert code_of("D = 4") == "D = 4"


def test_a_stage_reward_named_code_tests_runs_in_the_hosts_bubblewrap(sandboxes):
    combined = CombinedReward([RewardSpec(name="code_tests", args={"tests_field": "checks", "mode": "all"})])
    sample = RewardInput(row={"checks": ASSERTS}, messages=[], final_text="def add(a, b):\n    return a + b")
    assert combined.score(sample).components == {"code_tests": 1.0}


@pytest.mark.parametrize(("args", "problem"), [
    ({"mode": "most"}, "'mode' must be one of"),
    ({"timeout_s": 0}, "'timeout_s' must be above 0"),
    ({"memory_mb": 8}, "'memory_mb' must be at least 64"),
])
def test_bad_code_tests_args_fail_at_load(args, problem):
    with pytest.raises(RewardLoadError, match=problem):
        load_reward(RewardSpec(name="code_tests", args=args))

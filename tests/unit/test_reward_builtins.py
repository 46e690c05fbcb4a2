"""The built-in rewards: ``math_verify`` (the completion's final answer against the record's
``answer``) and ``code_tests`` (the completion's code against the record's ``tests``, each test in a
bubblewrap sandbox with resource limits): what they score, what the sandboxed code cannot reach or
change, and how a recipe without a sandbox is refused."""

from __future__ import annotations

import pytest
import torch
from helpers import write_recipe

from llmft.errors import UserError
from llmft.objectives.rewards import Rewards
from llmft.scoring.builtin_rewards import completion_code, make_builtin
from llmft.scoring.probe import bwrap_problem

needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")
SOLUTION = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        (r"so the answer is $\boxed{1/2}$", "0.5", 1.0),
        (r"$\frac{1}{2}$", r"\frac12", 1.0),
        ("I think it is 3.", "4", 0.0),
        (r"the total is $\boxed{12}$, not 13", "12", 1.0),
        (r"so $x^2 = 4$ and $x = \boxed{\sqrt{4}}$.", "2", 1.0),
        ("no idea", "", None),  # an answer that does not parse: no opinion
    ],
)
def test_math_verify_compares_the_final_answer(completion, answer, reward):
    assert make_builtin("math_verify")("a question", completion, answer=answer) == reward


def test_math_verify_names_the_field_a_record_lacks():
    with pytest.raises(
        ValueError,
        match=r"^math_verify reads the record's 'answer' field, which this record lacks \(its fields: solution\)$",
    ):
        make_builtin("math_verify")("q", "1", solution="1")


def test_math_verify_scores_in_a_worker():
    rewards = Rewards([{"builtin": "math_verify", "sandbox": "none"}], torch.device("cpu"), None, workers=1)
    try:
        scores = rewards.score(["q", "q"], [r"$\boxed{1/2}$", "7"], [{"answer": "0.5"}, {"answer": "8"}])
    finally:
        rewards.close()
    assert rewards.names == ("math_verify",) and scores[:, 0].tolist() == [1.0, 0.0]


def test_the_code_is_the_last_fenced_block_or_the_whole_completion():
    assert completion_code("```py\nx = 1\n```\nthen\n```python\nx = 2\n```") == "x = 2\n"
    assert completion_code("```\ny = 3\n```") == "y = 3\n"
    assert completion_code("z = 4") == "z = 4"


@pytest.mark.parametrize("sandbox", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_code_tests_scores_the_fraction_of_tests_passed(sandbox):
    code_tests = make_builtin("code_tests", timeout_s=30, sandbox=sandbox)
    assert code_tests("q", SOLUTION, tests="assert add(1, 2) == 3") == 1.0
    assert code_tests("q", SOLUTION, tests=["assert add(1, 2) == 3", "assert add(2, 2) == 5"]) == 0.5
    assert code_tests("q", "def add(a, b) return", tests="assert add(1, 2) == 3") == 0.0  # a syntax error
    # exiting before the tests ran passes none of them
    assert code_tests("q", "import os, sys\nsys.exit(0)", tests="assert False") == 0.0
    assert code_tests("q", "import os\nos._exit(0)", tests="assert False") == 0.0


@needs_bwrap
def test_code_tests_cannot_reach_the_network_the_home_or_the_environment(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    key = home / ".ssh" / "id_rsa"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY----- secret")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("LLMFT_TEST_SECRET", "hunter2")
    code_tests = make_builtin("code_tests", timeout_s=30, sandbox="bwrap")
    reads = f"import os\ndef leak():\n    return open(os.path.expanduser('~/.ssh/id_rsa')).read() + open({str(key)!r}).read()"
    assert code_tests("q", reads, tests="assert 'PRIVATE KEY' in leak()") == 0.0
    connects = (
        "import socket\ndef call():\n    socket.create_connection(('1.1.1.1', 53), timeout=3).close()\n    return True"
    )
    assert code_tests("q", connects, tests="assert call()") == 0.0
    assert code_tests("q", "import os", tests="assert os.environ.get('LLMFT_TEST_SECRET') == 'hunter2'") == 0.0
    # the same code, unconfined, reaches what the sandbox hides (the test can fail)
    unconfined = make_builtin("code_tests", timeout_s=30, sandbox="none")
    assert unconfined("q", f"def leak():\n    return open({str(key)!r}).read()", tests="assert 'KEY' in leak()") == 1.0
    assert key.read_text() == "-----BEGIN OPENSSH PRIVATE KEY----- secret"


@needs_bwrap
@pytest.mark.timeout(60)  # the loop ends at its 2 s limit, or the test fails here
def test_code_tests_that_fills_the_disk_or_loops_gets_0_and_changes_nothing(tmp_path):
    outside = tmp_path / "big.bin"
    code_tests = make_builtin("code_tests", timeout_s=4, sandbox="bwrap")  # 2 s per test (1 test + 1 share)
    fills = (
        "def fill(path):\n    with open(path, 'wb') as f:\n        while True:\n            f.write(b'x' * (1 << 20))"
    )
    assert code_tests("q", fills, tests="fill('/tmp/big.bin')") == 0.0  # RLIMIT_FSIZE / the 64 MiB /tmp
    assert code_tests("q", fills, tests=f"fill({str(outside)!r})") == 0.0
    assert not outside.exists()
    assert code_tests("q", "while True:\n    pass", tests="assert True") == 0.0  # ended by its limits
    before = sorted(p.name for p in tmp_path.iterdir())
    writes = f"open({str(tmp_path / 'x.txt')!r}, 'w').write('x')"
    assert code_tests("q", writes, tests="assert True") == 0.0  # /tmp is the sandbox's own
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_code_tests_names_a_record_without_tests():
    code_tests = make_builtin("code_tests", timeout_s=30, sandbox="none")
    with pytest.raises(ValueError, match=r"^code_tests reads the record's 'tests' field, which this record lacks"):
        code_tests("q", SOLUTION, answer="3")
    with pytest.raises(ValueError, match=r"^code_tests needs the record's 'tests' as a string or a list of strings"):
        code_tests("q", SOLUTION, tests=[1, 2])


def test_code_tests_without_a_sandbox_is_refused_at_the_recipe_check(tmp_path, monkeypatch):
    from llmft.plan.resolve import load_plan
    from llmft.recipe.load import RecipeError

    monkeypatch.setattr("llmft.scoring.probe.bwrap_problem", lambda: "bwrap is not installed (not on PATH)")
    common = dict(
        train__objective="grpo",
        rollout__num_generations=4,
        rollout__max_new_tokens=8,
        rollout__backend="file",
        rollout__file=str(tmp_path / "rollouts.jsonl"),
    )
    recipe = write_recipe(tmp_path, rewards=[{"builtin": "code_tests", "weight": 1.0}], **common)
    with pytest.raises((RecipeError, UserError)) as e:
        load_plan(recipe)
    assert (
        "rewards[0]: code_tests runs the completions' code in a bubblewrap sandbox, but bwrap is not installed "
        "(not on PATH). Install bubblewrap (`apt-get install bubblewrap`; it needs unprivileged user namespaces, "
        "or root), or set rewards[0].sandbox: none to run the completions' code unconfined (only where losing "
        "the machine to it is acceptable)."
    ) in str(e.value)
    unconfined = write_recipe(tmp_path / "none", rewards=[{"builtin": "code_tests", "sandbox": "none"}], **common)
    try:
        load_plan(unconfined)
    except (RecipeError, UserError) as err:  # whatever else the tiny recipe lacks, not the sandbox
        assert "sandbox" not in str(err), str(err)

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmft.plan.batch import BatchError, BatchPlan, divisors, resolve_for_world, sequences_from_tokens, solve_batch

pos = st.integers(min_value=1, max_value=512)
dps = st.integers(min_value=1, max_value=64)


@given(g=pos, m=pos, dp=dps)
def test_solve_accumulation_exact_or_error(g, m, dp):
    try:
        plan = solve_batch(g, m, "auto", dp)
    except BatchError as e:
        assert g % (m * dp) != 0
        msg = str(e)
        assert f"global_batch_size {g}" in msg and f"micro {m}" in msg and f"data-parallel {dp}" in msg
        return
    assert plan.micro_batch_size * plan.gradient_accumulation_steps * plan.dp_size == g
    assert (plan.micro_batch_size, plan.dp_size) == (m, dp)


@given(g=pos, a=pos, dp=dps)
def test_solve_micro_exact_or_error(g, a, dp):
    try:
        plan = solve_batch(g, None, a, dp)
    except BatchError as e:
        assert g % (a * dp) != 0
        assert f"accumulation {a}" in str(e)
        return
    assert plan.micro_batch_size * a * dp == g


@given(m=pos, a=pos, dp=dps)
def test_solve_global_always_whole(m, a, dp):
    assert solve_batch("auto", m, a, dp).global_batch_size == m * a * dp


@given(g=pos, m=pos, a=pos, dp=dps)
def test_all_given_must_agree(g, m, a, dp):
    if m * a * dp == g:
        assert solve_batch(g, m, a, dp) == BatchPlan(g, m, a, dp)
    else:
        with pytest.raises(BatchError, match=f"= {m * a * dp}, but global_batch_size is {g}"):
            solve_batch(g, m, a, dp)


def test_non_whole_error_names_nearest_choices():
    with pytest.raises(BatchError) as e:
        solve_batch(16, 3, None, 2)
    msg = str(e.value)
    assert "global_batch_size in {12, 18}" in msg
    assert "micro_batch_size in {1, 2, 4, 8}" in msg
    assert "never rounds" in msg


def test_floor_division_trap_is_an_error():
    # litgpt's trap: 16 sequences on 3 GPUs silently became 12.
    with pytest.raises(BatchError, match="global_batch_size in {15, 18}"):
        solve_batch(16, 1, None, 3)


def test_two_unknowns_is_an_error():
    with pytest.raises(BatchError, match="only one of the three batch keys can be solved"):
        solve_batch(16, "auto", "auto", 2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "four", True])
def test_bad_values(bad):
    with pytest.raises(BatchError, match="must be a positive integer or auto"):
        solve_batch(bad, 1, None, 1)


def test_token_budget():
    assert sequences_from_tokens(8192, 2048) == 4
    with pytest.raises(BatchError, match="Choose 8192 or 10240"):
        sequences_from_tokens(9000, 2048)


@given(m=st.integers(1, 8), a=st.integers(1, 8), dp=st.integers(1, 8), new_dp=st.integers(1, 16))
def test_resolve_for_world_keeps_global(m, a, dp, new_dp):
    plan = BatchPlan(m * a * dp, m, a, dp)
    try:
        new, note = resolve_for_world(plan, new_dp)
    except BatchError as e:
        assert plan.global_batch_size % new_dp != 0
        assert "not divisible" in str(e)
        return
    assert new.global_batch_size == plan.global_batch_size
    assert new.micro_batch_size <= m
    assert new.micro_batch_size * new.gradient_accumulation_steps * new_dp == plan.global_batch_size
    assert (note is None) == (new_dp == dp)


# The error paths list divisors: found from a factorization, not by trying every number up to N.
P, Q = 1_000_000_007, 998_244_353  # primes
HUGE = P * Q  # 998244359987710471


@given(n=st.integers(1, 5000))
def test_divisors_are_exact(n):
    assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.timeout(10)
def test_divisors_of_huge_numbers():
    assert divisors(P) == [1, P]
    assert divisors(HUGE) == [1, Q, P, HUGE]
    assert divisors(2**62) == [2**k for k in range(63)]
    assert len(divisors(2**6 * 3**4 * 5**3 * 7**2 * 11 * 13 * 17 * 19 * 23)) == 7 * 5 * 4 * 3 * 2**5


@pytest.mark.timeout(10)
def test_huge_prime_global_batch():
    with pytest.raises(BatchError) as e:
        solve_batch(P, 2, "auto", 1)
    msg = str(e.value)
    assert f"global_batch_size in {{{P - 1}, {P + 1}}}" in msg
    assert f"micro_batch_size in {{1, {P}}} (divisors of {P} / 1)" in msg


@pytest.mark.timeout(10)
def test_huge_composite_global_batch():
    with pytest.raises(BatchError) as e:
        solve_batch(HUGE, None, 2, 1)
    assert f"gradient_accumulation_steps in {{1, {Q}, {P}, {HUGE}}}" in str(e.value)
    with pytest.raises(BatchError) as e:
        solve_batch(2**62, 3, None, 1)
    assert "micro_batch_size in {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, ...}" in str(e.value)


@pytest.mark.timeout(10)
def test_huge_plan_on_another_world():
    new, _ = resolve_for_world(BatchPlan(2 * P, 2, P, 1), 2)
    assert (new.micro_batch_size, new.gradient_accumulation_steps) == (1, P)
    with pytest.raises(BatchError, match=f"data-parallel size in {{1, 2, {P}, {2 * P}}}"):
        resolve_for_world(BatchPlan(2 * P, 2, P, 1), 3)


def test_batch_numbers_beyond_64_bits_are_refused():
    with pytest.raises(BatchError, match="must be a positive integer or auto"):
        solve_batch(2**63, 1, None, 1)

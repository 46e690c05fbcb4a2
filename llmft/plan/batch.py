"""The batch equation: ``global = micro x accumulation x dp``, where ``dp = world / the split dimensions``
(``sequence_parallel``: ranks that share each sequence; ``llmft.plan.dims``).

Pure integer arithmetic, no torch. Any one unknown is solved from the other two
and ``dp_size``; nothing is ever rounded. When no whole solution exists the
error prints the equation and the nearest choices that do work.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from llmft.errors import Problem, UserError
from llmft.plan import dims

KEYS = ("global_batch_size", "micro_batch_size", "gradient_accumulation_steps")
MAX_INT = 2**63 - 1  # as llmft.recipe.validate: a batch number beyond it is refused


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    dp_size: int
    # The split dimensions over 1 (``ParallelLayout.splits``: ranks that share each data-parallel
    # rank's sequences), as files name them: ``(("sequence_parallel", 2),)``. world = dp_size x their product.
    splits: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        assert self.micro_batch_size * self.gradient_accumulation_steps * self.dp_size == self.global_batch_size

    @property
    def sp(self) -> int:
        """Ranks that share each sequence (``distributed.sequence_parallel``)."""
        return dict(self.splits).get("sequence_parallel", 1)

    @property
    def local_batch_size(self) -> int:
        """Sequences one rank processes per optimizer step."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    def equation(self) -> str:
        dp = f"data-parallel {self.dp_size}"
        if self.splits:
            world = self.dp_size * math.prod(n for _, n in self.splits)
            titles = " / ".join(f"{dims.title(key)} {n}" for key, n in self.splits)
            dp += f" (world {world} / {titles})"
        return (
            f"micro {self.micro_batch_size} x accumulation {self.gradient_accumulation_steps} "
            f"x {dp} = global {self.global_batch_size}"
        )

    def to_dict(self) -> dict[str, int]:
        """The four numbers (and the split dimensions over 1), as every file llmft writes holds them
        (``plan.yaml``, ``trainer_state.json``, trackers)."""
        return {
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "dp_size": self.dp_size,
            **dict(self.splits),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchPlan:
        """Read what ``to_dict`` wrote; other keys (``equation``, ``tokens_per_step``) are ignored.
        Raises ``KeyError`` for a missing number and ``ValueError`` when they break the equation
        (a file edited by hand), which the reader reports naming its file."""
        g, m, a, dp = (int(data[k]) for k in (*KEYS, "dp_size"))
        if m * a * dp != g:
            raise ValueError(f"micro {m} x accumulation {a} x data-parallel {dp} is not global {g}")
        sizes = ((d.plan_key, int(data.get(d.plan_key, 1))) for d in dims.splits())
        return cls(g, m, a, dp, tuple((key, n) for key, n in sizes if n > 1))


class BatchError(UserError):
    pass


def divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1``, ascending, from its prime factorization.

    The error paths list divisors of whatever batch a user typed (a prime of ten digits, say):
    trying every number up to ``n`` would take minutes, this takes milliseconds for any ``n`` below
    2**64 (at most ~10**5 divisors). Exact below 3.3e24; above, a factor that Pollard's rho does
    not split within its budget is kept whole, so the list may miss divisors but always ends."""
    out = [1]
    for p, e in _factorize(n).items():
        out = [d * p**k for d in out for k in range(e + 1)]
    return sorted(out)


def _factorize(n: int) -> Counter:
    found: Counter = Counter()
    for p in (2, 3, 5, 7, 11, 13):
        while n % p == 0:
            found[p] += 1
            n //= p
    todo = [n] if n > 1 else []
    while todo:
        m = todo.pop()
        d = None if _is_probable_prime(m) else _pollard_brent(m)
        if d is None:
            found[m] += 1
        else:
            todo += [d, m // d]
    return found


_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # Miller-Rabin: deterministic below 3.3e24


def _is_probable_prime(n: int) -> bool:
    if n < 2:
        return False
    if n in _WITNESSES:
        return True
    if any(n % p == 0 for p in _WITNESSES):
        return False
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _pollard_brent(n: int, budget: int = 1 << 22) -> int | None:
    """A non-trivial factor of the odd composite ``n``, or None when ``budget`` steps did not find one
    (expected ~n**0.25 steps: ~65,000 below 2**64)."""
    for c in range(1, 16):
        y, r, q, g, x, ys = 2, 1, 1, 1, 2, 2
        while g == 1 and r <= budget:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(128, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += 128
            r *= 2
        if g == n:  # the batched product overshot: step again one at a time
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if 1 < g < n:
            return g
    return None


def _nearest_multiples(n: int, unit: int) -> list[int]:
    low = (n // unit) * unit
    return sorted({m for m in (low, low + unit) if m > 0})


def _fmt(values: list[int], limit: int = 12) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return "{" + shown + (", ..." if len(values) > limit else "") + "}"


def _check_value(key: str, value: object) -> int | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INT:
        raise BatchError(
            Problem(
                f"batch.{key}",
                f"must be a positive integer or auto, got {value!r}",
                f"Set batch.{key}=auto or a whole number in [1, 2**63).",
            )
        )
    return value


def solve_batch(
    global_batch_size: int | str | None = None,
    micro_batch_size: int | str | None = None,
    gradient_accumulation_steps: int | str | None = None,
    dp_size: int = 1,
    splits: tuple[tuple[str, int], ...] = (),
) -> BatchPlan:
    """Solve ``global = micro x accumulation x dp`` for the one unknown (None or "auto"); ``splits``
    (``ParallelLayout.splits``) are carried into the plan, the equation counts data-parallel ranks."""
    return replace(_solve(global_batch_size, micro_batch_size, gradient_accumulation_steps, dp_size), splits=splits)


def _solve(
    global_batch_size: int | str | None,
    micro_batch_size: int | str | None,
    gradient_accumulation_steps: int | str | None,
    dp_size: int,
) -> BatchPlan:
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or not 1 <= dp_size <= MAX_INT:
        raise BatchError(Problem("dp_size", f"must be a positive integer, got {dp_size!r}"))
    g = _check_value("global_batch_size", global_batch_size)
    m = _check_value("micro_batch_size", micro_batch_size)
    a = _check_value("gradient_accumulation_steps", gradient_accumulation_steps)
    dp = dp_size
    unknown = [k for k, v in zip(KEYS, (g, m, a), strict=False) if v is None]

    if len(unknown) > 1:
        raise BatchError(
            Problem(
                "batch",
                f"{' and '.join('batch.' + k for k in unknown)} are both auto; only one of the three batch keys can be solved",
                "Give two of global_batch_size, micro_batch_size, gradient_accumulation_steps "
                "(e.g. batch.global_batch_size=32 batch.micro_batch_size=2), or set distributed.gpu_memory_gb "
                "with micro_batch_size=auto to have the largest micro-batch that fits picked.",
            )
        )
    if not unknown:
        if m * a * dp == g:
            return BatchPlan(g, m, a, dp)
        hints = [f"global_batch_size={m * a * dp}"]
        if g % (m * dp) == 0:
            hints.append(f"gradient_accumulation_steps={g // (m * dp)}")
        if g % (a * dp) == 0:
            hints.append(f"micro_batch_size={g // (a * dp)}")
        raise BatchError(
            Problem(
                "batch",
                f"inconsistent: micro {m} x accumulation {a} x data-parallel {dp} = {m * a * dp}, "
                f"but global_batch_size is {g}",
                f"Set one of: {', or '.join(hints)}; or set one key to auto to have it solved.",
            )
        )
    if unknown == ["gradient_accumulation_steps"]:
        if g % (m * dp) == 0:
            return BatchPlan(g, m, g // (m * dp), dp)
        fixes = [f"global_batch_size in {_fmt(_nearest_multiples(g, m * dp))} (multiples of {m} x {dp})"]
        if g % dp == 0:
            fixes.append(f"micro_batch_size in {_fmt(divisors(g // dp))} (divisors of {g} / {dp})")
        else:
            fixes.append(f"a data-parallel size that divides {g}: {_fmt(divisors(g))}")
        raise BatchError(
            Problem(
                "batch",
                f"global_batch_size {g} is not divisible by micro {m} x data-parallel {dp} = {m * dp}: "
                f"accumulation would be {g}/{m * dp} = {g / (m * dp):.4g}, and llmft never rounds",
                "Choose " + ", or ".join(fixes) + ".",
            )
        )
    if unknown == ["micro_batch_size"]:
        if g % (a * dp) == 0:
            return BatchPlan(g, g // (a * dp), a, dp)
        fixes = [f"global_batch_size in {_fmt(_nearest_multiples(g, a * dp))} (multiples of {a} x {dp})"]
        if g % dp == 0:
            fixes.append(f"gradient_accumulation_steps in {_fmt(divisors(g // dp))} (divisors of {g} / {dp})")
        raise BatchError(
            Problem(
                "batch",
                f"global_batch_size {g} is not divisible by accumulation {a} x data-parallel {dp} = {a * dp}: "
                f"micro-batch would be {g / (a * dp):.4g}, and llmft never rounds",
                "Choose " + ", or ".join(fixes) + ".",
            )
        )
    return BatchPlan(m * a * dp, m, a, dp)


def sequences_from_tokens(global_batch_tokens: int, max_seq_len: int) -> int:
    """With packing every row is max_seq_len tokens, so a token budget is a whole number of rows."""
    if global_batch_tokens % max_seq_len:
        low = max(global_batch_tokens // max_seq_len, 1) * max_seq_len
        raise BatchError(
            Problem(
                "batch.global_batch_tokens",
                f"{global_batch_tokens} is not a multiple of data.max_seq_len {max_seq_len}",
                f"Choose {low} or {low + max_seq_len} ({low // max_seq_len} or {low // max_seq_len + 1} packed rows).",
            )
        )
    return global_batch_tokens // max_seq_len


def resolve_for_world(
    plan: BatchPlan, dp_size: int, splits: tuple[tuple[str, int], ...] = ()
) -> tuple[BatchPlan, str | None]:
    """Re-check a compiled plan against the real world size.

    Keeps the global batch and the micro-batch and re-solves accumulation. If that is
    not whole, keeps the global batch and the per-rank load and tries a smaller micro-batch.
    Returns the plan and a note for the log when anything changed.
    """
    if dp_size == plan.dp_size:
        return replace(plan, splits=splits), None
    g, m = plan.global_batch_size, plan.micro_batch_size
    if g % (m * dp_size) == 0:
        new = BatchPlan(g, m, g // (m * dp_size), dp_size, splits)
    elif g % dp_size == 0:
        local = g // dp_size
        micro = max(d for d in divisors(local) if d <= m)
        new = BatchPlan(g, micro, local // micro, dp_size, splits)
    else:
        raise BatchError(
            Problem(
                "batch",
                f"the plan was compiled for data-parallel {plan.dp_size} ({plan.equation()}), but "
                f"{dp_size} processes were launched and global_batch_size {g} is not divisible by {dp_size}",
                f"Launch with a data-parallel size in {_fmt(divisors(g))}, or recompile with a different "
                "batch.global_batch_size.",
            )
        )
    note = f"world size {dp_size} differs from the compiled {plan.dp_size}: re-solved to {new.equation()}"
    return new, note

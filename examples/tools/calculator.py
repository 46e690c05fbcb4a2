"""The calculator tool of the tool-calling quickstart (data/quickstart-tools/, scripts/make_tools_data.py).

A plain function in TRL's tool contract: type hints and a Google-style docstring with an ``Args:``
section, so that ``transformers.utils.get_json_schema(multiply)`` describes it. The rollout calls it
with the arguments of the model's tool call, ``multiply(**arguments)``, and appends ``str(result)``
as a tool message. Arguments that are not integers raise ``TypeError`` (TRL's tool loop, for one,
appends ``{"error": ...}`` as the tool's result instead).

Name it ``calculator:multiply``, with this folder importable: run from the repository root with
``PYTHONPATH=examples/tools``.
"""

from __future__ import annotations


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product a * b.
    """
    # The arguments are whatever the model wrote: refuse anything but integers (a string times an
    # int would repeat the string), so a bad call reads as an error message, not a wrong number.
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    return a * b

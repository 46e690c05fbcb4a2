"""The one exception type users see.

Every problem a user can fix (a bad recipe, bad data, a bad path) is raised as
a ``UserError``. The CLI prints it as one paragraph and exits non-zero; it
never shows a traceback for these.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass
class Problem:
    """One thing wrong: where, what, and how to fix it."""

    where: str  # dotted recipe key, "file:line", or a path
    what: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        return f"{text}. {self.fix}" if self.fix else text


class UserError(Exception):
    """An error the user can fix. Carries one or more ``Problem`` s."""

    exit_code = 2

    def __init__(self, *problems: Problem | str, title: str = "") -> None:
        self.problems = [p if isinstance(p, Problem) else Problem("", p) for p in problems]
        self.title = title
        super().__init__(self.render())

    def render(self) -> str:
        lines = [str(p) for p in self.problems]
        if len(lines) == 1 and not self.title:
            return lines[0]
        head = self.title or f"{len(lines)} problems"
        return head + ":\n" + "\n".join(f"  - {line}" for line in lines)


class TrainingDiverged(UserError):
    """The loss became NaN or inf."""

    exit_code = 3


# A library's error wrapped into a Problem keeps its cause (type and first line) and gets the fix
# for that cause. Classified by the names of the exception types along the chain and by their
# messages, so that this module imports no library (huggingface_hub, safetensors, ...).
HUB_KERNELS, PACKAGE, OFFLINE, DAMAGED, ARCHITECTURE, NOT_FOUND, OTHER = (
    "hub kernels",
    "missing package",
    "offline",
    "damaged file",
    "unsupported architecture",
    "not found",
    "other",
)
_SIGNS = (  # (kind, type names along the chain, message fragments), first match wins
    (HUB_KERNELS, (), ("kernels-community/", "kernels are not available", "hub kernels")),
    (
        OFFLINE,
        ("LocalEntryNotFoundError", "OfflineModeIsEnabled"),
        (
            "offline mode",
            "offlinemodeisenabled",
            "couldn't connect",
            "couldn't reach",
            "not available in the local cache",
            "is not cached",
        ),
    ),
    (
        DAMAGED,
        ("SafetensorError", "JSONDecodeError", "UnicodeDecodeError", "UnpicklingError", "HeaderTooLarge"),
        ("not a valid json", "deserializing header", "incomplete metadata", "unexpected end", "invalid load key"),
    ),
    (
        ARCHITECTURE,
        (),
        ("does not recognize this architecture", "unrecognized configuration class", "unrecognized model in"),
    ),
    (PACKAGE, ("ImportError", "PackageNotFoundError"), ("is not installed", "please install")),
    (
        NOT_FOUND,
        (
            "RepositoryNotFoundError",
            "GatedRepoError",
            "RevisionNotFoundError",
            "EntryNotFoundError",
            "DatasetNotFoundError",
        ),
        ("is not a valid model identifier", "does not appear to have a file named", "404 client error"),
    ),
)


def first_line(e: BaseException) -> str:
    """The gist of a library error; a first line that only introduces the next one keeps both."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def cause_of(e: BaseException) -> str:
    """``Type: first line`` of a library error, as a wrapped error shows it."""
    return f"{type(e).__name__}: {first_line(e)}"


def _chain(e: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while e is not None and e not in seen and len(seen) < 8:
        seen.append(e)
        e = e.__cause__  # not __context__: an error met and handled on the way may be unrelated
    return seen


def cause_kind(e: BaseException) -> str:
    """Which of the causes a user fixes differently this error is (``OTHER`` when none)."""
    chain = _chain(e)
    names = {cls.__name__ for x in chain for cls in type(x).__mro__}
    text = " ".join(str(x) for x in chain).lower()
    for kind, types, fragments in _SIGNS:
        if names.intersection(types) or any(f in text for f in fragments):
            return kind
    return OTHER


def offline(flags: tuple[str, ...] = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")) -> bool:
    """Whether one of the Hugging Face offline variables ``flags`` is on (as huggingface_hub reads them)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in flags)


def _package(e: BaseException) -> str | None:
    for x in _chain(e):
        if getattr(x, "name", None) and isinstance(x, ImportError):
            return str(x.name).split(".")[0]
        found = re.search(r"pip install (?:-U |--upgrade )?[`'\"]?([A-Za-z0-9_.\-\[\]]+(?:[<>=!~]=?[0-9.]+)?)", str(x))
        if found:
            return found.group(1)
    return None


def cause_fix(e: BaseException, name: str | None = None, local: bool = False, dataset: bool = False) -> str | None:
    """The fix for ``e``'s cause, or None when it is none of the known ones. ``name``: what was being
    loaded (a hub id or a directory); ``local``: it is a directory on disk; ``dataset``: a hub dataset."""
    kind, what = cause_kind(e), f"'{name}'" if name else "it"
    download = f"hf download {name or '<id>'}" + (" --repo-type dataset" if dataset else "")
    if kind == HUB_KERNELS:
        return (
            "transformers was asked to replace layers by compiled kernels from the Hugging Face Hub "
            "(model.hub_kernels=true): set model.hub_kernels=false (the default), or install the `kernels` "
            "package and run once with network access so that the kernels are in the HF cache."
        )
    if kind == PACKAGE:
        pkg = _package(e)
        if pkg is None:
            return "Install the package the message names in this environment (pip install)."
        spec = f'"{pkg}"' if re.search(r"[<>=!~\[]", pkg) else pkg
        return f"Install the missing package in this environment: `pip install {spec}`."
    if kind == OFFLINE:
        why = "downloads are off (HF_HUB_OFFLINE=1)" if offline() else "the Hugging Face Hub cannot be reached"
        return (
            f"{what} is not in the local Hugging Face cache (HF_HOME) and {why}: download it once on a machine "
            f"with network access (`{download}`) into the HF_HOME this job uses, or point at "
            "a local directory (docs/offline.md)."
        )
    if kind == DAMAGED:
        again = "copy or save it again (save_pretrained)" if local else f"`{download} --force-download`"
        return f"A file of {what} is damaged or incomplete (an interrupted download, copy or save): {again}."
    if kind == ARCHITECTURE:
        return (
            f"This transformers ({_version('transformers')}) does not know the model_type of {what} (config.json): "
            "upgrade it (`pip install -U transformers`) if the model is newer, or use a model whose model_type "
            "it supports."
        )
    if kind == NOT_FOUND:
        if local:
            return f"{what} lacks a file from_pretrained needs: point at a directory written by save_pretrained."
        return "Check the hub id and the revision; a gated or private repo also needs `hf auth login`."
    return None


def library_problem(
    where: str,
    doing: str,
    e: BaseException,
    *,
    name: str | None = None,
    local: bool = False,
    dataset: bool = False,
    fix: str = "",
) -> Problem:
    """``where: doing (Type: message). <the fix for that cause>``; ``fix`` when the cause is none
    that ``cause_fix`` knows."""
    return Problem(where, f"{doing} ({cause_of(e)})", cause_fix(e, name, local, dataset) or fix)


def _version(package: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return "not installed"

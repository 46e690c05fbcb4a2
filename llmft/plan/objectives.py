"""The objective registry: one record per ``train.objective``, found by one lookup (``objective_spec``).

A record (``ObjectiveSpec``) says everything the rest of llmft needs to know about an objective:

- the kind of record it reads (``record``: a ``llmft.plan.kinds`` record, ``sequences``, ``pairs``,
  ``prompts`` or one a module registers; the data layer tokenizes, caches and collates by it) and the rows one item becomes (``rows_per_item``:
  1, 2 for a pair, or the recipe key that holds G for G completions per prompt);
- what the global count counts (``counts``: the loss is the sum of the global batch's item losses
  divided by it): ``tokens`` (target tokens), ``pairs``, ``completions``;
- the numbers it reads from each record besides its text (``fields``: e.g. a ``weight``; the data
  layer stores them with each item through the token cache and delivers each as a per-token
  tensor of the micro-batch, docs/data.md "Record fields");
- the head it trains (``head``), the frozen models it needs (``frozen``: ``reference``,
  ``reward_model``; the runtime asks the engine to build them, ``Engine.frozen_model``), the sums
  its micro loss returns (``metrics``), its words on the model card;
- what an item of its data is called (``unit``: ``sequences``, ``pairs``, ``completions``;
  ``data_words``), in the banner, ``llmft verify`` and the messages;
- the recipe sections it reads (``reads``): a key set in a section that some registered objective
  reads, and the run's objective reads nothing of, is refused (``unread_problems``: it would be
  silently ignored), naming the objectives that do read it;
- which code computes its loss (``runtime``), checks a recipe for it (``problems``), prints its
  lines under the batch line of ``llmft compile``, ``llmft plan`` and the banner (``summary``) and
  writes its model-card words (``card_words``): dotted paths imported only when they are used, as
  the engine record names its code (``llmft.plan.engines``). This module, like the rest of
  ``llmft.plan``, imports no torch; an objective's plan-side pieces are pure too
  (``plan/preference.py``: the DPO family's, ``plan/rl.py``: online RL's).

The loop never branches on the objective's name: it asks the runtime object to prepare the step's
micro-batches, for their count and for the micro loss numerator divided by the global count
(docs/design.md, docs/preference.md). Nothing outside this module and an objective's own module
compares objective names (``tests/unit/test_objectives.py``).

Adding an objective is a record and a module. The built-in ones are below; a user's module
registers its record with ``register_objective`` when it is imported, and a recipe names that
module in ``train.objective_module`` (imported by ``load_objective_module`` before anything reads
``train.objective``; docs/design.md "Adding an objective").

How a preference run gets its reference model is decided here too (``reference_kind``), once, from
the recipe: the plan carries the decision and the objective asks the engine for it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING, Callable, Literal

from llmft.errors import Problem, UserError
from llmft.plan.engines import load
from llmft.plan.kinds import PAIRS, PROMPTS, SEQUENCES, kind_names, kind_spec
from llmft.recipe.schema import Recipe
from llmft.recipe.sections import builtin_sections, import_module, registered_sections

if TYPE_CHECKING:
    from llmft.plan.batch import BatchPlan

# The kinds of record the data layer reads (``ObjectiveSpec.record``): the registry in
# ``llmft.plan.kinds`` (SEQUENCES, PAIRS, PROMPTS and any a user module registers).
# The frozen models an objective may ask for (``ObjectiveSpec.frozen``).
REFERENCE = "reference"  # the policy's initial function: adapters off, a frozen copy, or a named model
REWARD_MODEL = "reward_model"  # a scoring model (for generation-based objectives)
# The micro-batch's own keys: a record field (``ObjectiveSpec.fields``) cannot take one of these names.
BATCH_KEYS = (
    "input_ids",
    "labels",
    "attention_mask",
    "position_ids",
    "shift_labels",
    "sequence_index",
    "sequence_last",
    "num_pairs",
    "reference_logps",
)


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective: what it reads, what it counts, what it trains, what it needs, where its code lives."""

    name: str  # train.objective
    title: str  # in messages
    runtime: str | None  # the Objective class (torch side); None: not built yet (refused at resolve)
    counts: Literal["tokens", "pairs", "completions"]  # what the micro loss is normalised by (global batch)
    head: Literal["lm", "score"] = "lm"  # the causal-LM head, or a scalar score head
    record: str = SEQUENCES  # the kind of record it reads (a ``llmft.plan.kinds`` record's name)
    rows_per_item: int | str = 1  # rows an item becomes: 1, 2 (a pair), or a recipe key holding G
    # A recipe key holding G: G consecutive positions of the global order are one record's G items
    # (online RL: a prompt's G completions); None: a position is a record.
    group: str | None = None
    # A recipe key holding k: k optimizer steps in a row take the same global batch (online RL's
    # policy updates per generation batch); None: each step its own.
    repeats: str | None = None
    frozen: tuple[str, ...] = ()  # frozen models it may need (REFERENCE, REWARD_MODEL)
    metrics: tuple[str, ...] = ()  # the sums its micro loss returns, reported as global-batch means
    fields: tuple[str, ...] = ()  # numbers read from each record, batch[name] per token (docs/data.md)
    card: str = ""  # what it is, in the model card of an export
    tagged: bool = True  # the model card tags an export with its name (not the default objective's)
    unit: str = "sequences"  # an item of its data, in messages (the global batch counts them)
    data_words: str = "training {unit}"  # its data's items, in messages ({unit}; {G}: the group size)
    # The recipe sections it reads ("preference"), or single keys of one it reads ("preference.reference"):
    # a section it reads nothing of is refused when set (unread_problems), unless it ``tolerates`` it.
    reads: tuple[str, ...] = ()
    tolerates: tuple[str, ...] = ()  # sections it does not read, whose keys it leaves alone (ignored)
    settings: str = ""  # what its sections are, in messages ("online RL's settings")
    # Its code by dotted path ("module:attribute"), imported when used (pure: no torch):
    problems: str | None = None  # (recipe, where) -> [Problem]: what this objective alone refuses
    summary: str | None = None  # (plan) -> [str]: its lines under the batch line (compile, plan, banner)
    card_words: str | None = None  # (spec, recipe as a dict) -> str: its model-card words (else ``card``)

    @property
    def pairs(self) -> bool:
        """An item is a preference pair (``batch.global_batch_size`` counts pairs)."""
        return self.record == PAIRS

    def packed(self, recipe: Recipe) -> bool:
        """Its items are packed rows (``data.packing`` packs a kind that packs, ``RecordKind.packs``:
        sequences; a pair stays a pair)."""
        return bool(recipe.data.packing) and kind_spec(self.record).packs

    def items(self, recipe: Recipe) -> str:
        """What one item of its training data is called: its ``unit``, or ``rows`` when packed."""
        return "rows" if self.packed(recipe) else self.unit

    def describe_items(self, recipe: Recipe) -> str:
        """Its training data's items in a message (``data_words``): "preference pairs", "rows after packing"."""
        if self.packed(recipe):
            return "rows after packing"
        return self.data_words.format(unit=self.unit, G=self.group_size(recipe))

    def reads_from(self, section: str) -> bool:
        """It reads ``section``, or a key of it."""
        return any(read == section or read.startswith(section + ".") for read in self.reads)

    def group_size(self, recipe: Recipe) -> int:
        """G: consecutive positions of the global order that are one record's items (1 without ``group``)."""
        if self.group is None:
            return 1
        section, _, key = self.group.partition(".")
        return int(getattr(getattr(recipe, section), key))

    def repeat_count(self, recipe: Recipe) -> int:
        """k: optimizer steps that take each global batch (1 without ``repeats``)."""
        if self.repeats is None:
            return 1
        section, _, key = self.repeats.partition(".")
        return int(getattr(getattr(recipe, section), key))

    def rows(self, recipe: Recipe | None = None) -> int:
        """Sequences one item of the data becomes (a micro-batch of P items runs P x this rows)."""
        if isinstance(self.rows_per_item, int):
            return self.rows_per_item
        assert recipe is not None, f"{self.name}: rows per item is {self.rows_per_item}, read from the recipe"
        section, _, key = self.rows_per_item.partition(".")
        return int(getattr(getattr(recipe, section), key))


DPO_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracy",
    "rewards/margin",
    "logps/chosen",
    "logps/rejected",
)

# Sums the GRPO micro loss returns; kl, clip and entropy are token means, the rest completion means.
GRPO_METRICS = ("kl", "clip_fraction", "entropy", "completion_tokens", "completions")
# An online RL step's mean total reward of its completions (TRL's name), which ``llmft plot`` reads as
# the mark of an RL run and draws first.
RL_REWARD = "reward"
# Per reward column run in workers (rl.reward_workers), the step's calls past their deadline and
# those whose worker died (a limit, a crash), summed over the ranks: ``reward_timeouts/<name>``.
REWARD_TIMEOUTS = "reward_timeouts/"
REWARD_FAILURES = "reward_failures/"

DEFAULT_OBJECTIVE = "sft"  # train.objective's default (recipe/schema.py)
# What the objectives over preference pairs share: the record, the count, the words.
_PAIR_RECORD = dict(counts="pairs", record=PAIRS, rows_per_item=2, unit="pairs", data_words="preference pairs")
_BUILT_IN: tuple[ObjectiveSpec, ...] = (
    ObjectiveSpec(
        name="sft",
        title="SFT",
        runtime="llmft.objectives.sft:SFTObjective",
        counts="tokens",
        card="sft (next-token loss on the target tokens)",
        tagged=False,
        tolerates=("preference",),  # preference.* is ignored by SFT, not refused
    ),
    ObjectiveSpec(
        name="dpo",
        title="DPO",
        runtime="llmft.objectives.preference:PreferenceObjective",
        frozen=(REFERENCE,),
        metrics=DPO_METRICS,
        card="dpo",  # followed by its preference.* settings (card_words)
        reads=("preference",),
        settings="the DPO family's settings",
        problems="llmft.plan.preference:preference_problems",
        card_words="llmft.plan.preference:card_words",
        **_PAIR_RECORD,
    ),
    ObjectiveSpec(
        name="reward",
        title="reward model",
        runtime="llmft.objectives.reward:RewardObjective",
        head="score",
        metrics=DPO_METRICS[:4],
        card="reward (a scalar score head, loss -log sigmoid(r_chosen - r_rejected) per pair)",
        **_PAIR_RECORD,
    ),
    ObjectiveSpec(
        name="grpo",
        title="GRPO",
        runtime="llmft.objectives.grpo:GRPOObjective",
        counts="completions",
        record=PROMPTS,
        group="rollout.num_generations",
        repeats="rl.iterations",
        frozen=(REFERENCE, REWARD_MODEL),
        metrics=GRPO_METRICS,
        card="grpo (online RL: G sampled completions per prompt, group-relative advantages, clipped surrogate)",
        unit="completions",
        data_words="{unit} (prompts x G {G})",
        reads=("rollout", "rl", "rewards", "preference.reference"),  # its named reference model
        settings="online RL's settings",
        problems="llmft.plan.rl:rl_problems",
        summary="llmft.plan.rl:rl_lines",
        card_words="llmft.plan.rl:card_words",
    ),
)

_BY_NAME: dict[str, ObjectiveSpec] = {spec.name: spec for spec in _BUILT_IN}


def objectives() -> tuple[ObjectiveSpec, ...]:
    """Every registered objective: the built-in ones, then those user modules registered."""
    return tuple(_BY_NAME.values())


def objective_names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


OBJECTIVES = _BUILT_IN
OBJECTIVE_NAMES: tuple[str, ...] = tuple(spec.name for spec in _BUILT_IN)

# Losses that compare the policy with itself only: no reference model is built or run.
REFERENCE_FREE_LOSSES = ("simpo", "orpo")

# How a preference run gets its reference log-probs (RunPlan.reference).
NO_REFERENCE = "none"
ADAPTERS_DISABLED = "adapters_disabled"  # LoRA/QLoRA: the policy itself inside PEFT's disable_adapter()
FROZEN_COPY = "frozen_copy"  # full fine-tune: a frozen copy of the initial weights, built like the policy
REFERENCE_MODEL = "model"  # preference.reference names a model: built like the policy's base


def register_objective(spec: ObjectiveSpec) -> ObjectiveSpec:
    """Add ``spec`` to the registry (a user module calls this when it is imported). Registering the
    same record again is a no-op (a module imported twice); another record under a taken name is an error."""
    known = _BY_NAME.get(spec.name)
    problems = []
    if known is not None and known != spec:
        problems.append(
            Problem(
                "train.objective_module",
                f"registers objective {spec.name!r}, which is registered already ({known.runtime})",
                "Give the new objective a name of its own.",
            )
        )
    if spec.record not in kind_names():
        problems.append(
            Problem(
                "train.objective_module",
                f"registers objective {spec.name!r} reading {spec.record!r} records",
                f"Use one of the record kinds the data layer reads: {', '.join(kind_names())}, or register "
                "the kind first (llmft.plan.kinds.register_kind).",
            )
        )
        raise UserError(*problems)
    problems += _field_problems(spec) + _reads_problems(spec)
    if problems:
        raise UserError(*problems)
    _BY_NAME[spec.name] = spec
    return spec


def _field_problems(spec: ObjectiveSpec) -> list[Problem]:
    """A record field must be a name of its own in the micro-batch, read from one row per record."""
    if not spec.fields:
        return []
    if not kind_spec(spec.record).record_fields:
        carry = [k for k in kind_names() if kind_spec(k).record_fields]
        return [
            Problem(
                "train.objective_module",
                f"registers objective {spec.name!r} reading fields {', '.join(spec.fields)} from {spec.record!r} "
                f"records; record fields are read from {' or '.join(carry)} records only",
                f"Declare fields only on an objective with record={carry[0]!r}.",
            )
        ]
    bad = [f for f in spec.fields if not f.isidentifier() or f in BATCH_KEYS or spec.fields.count(f) > 1]
    if bad:
        return [
            Problem(
                "train.objective_module",
                f"registers objective {spec.name!r} with fields {', '.join(map(repr, bad))}",
                f"Name each field once, as an identifier that is none of the micro-batch's keys ({', '.join(BATCH_KEYS)}).",
            )
        ]
    return []


def _reads_problems(spec: ObjectiveSpec) -> list[Problem]:
    """What a record reads (``reads``, ``tolerates``) must be the recipe's sections or their keys: the
    schema's, or one a module registered (``llmft.recipe.sections.register_section``) before."""
    sections = {f.name: getattr(Recipe(), f.name) for f in fields(Recipe)}
    sections.update({name: s.schema() for name, s in registered_sections().items()})

    def known(read: str) -> bool:
        section, dot, key = read.partition(".")
        if section not in sections:
            return False
        return not dot or (is_dataclass(sections[section]) and key in {f.name for f in fields(sections[section])})

    bad = [read for read in (*spec.reads, *spec.tolerates) if not known(read)]
    if not bad:
        return []
    return [
        Problem(
            "train.objective_module",
            f"registers objective {spec.name!r} reading {', '.join(map(repr, bad))}, which the recipe has not",
            f'Name sections of the recipe ({", ".join(builtin_sections())}) or keys of one ("rl.beta"); a '
            "section of its own is registered first, with llmft.recipe.sections.register_section.",
        )
    ]


def load_objective_module(recipe: Recipe) -> None:
    """Import ``train.objective_module`` (a user's module that registers its objective). Importing
    it runs its code: it is the user's own, named explicitly, like a reward function's ``module:name``."""
    if recipe.train.objective_module:  # loading the recipe imported it where it adds a section
        import_module(recipe.train.objective_module, "train.objective_module")


def registered(name: str) -> ObjectiveSpec | None:
    """The record of ``name``, or None when no objective of that name is registered in this process."""
    return _BY_NAME.get(name)


def objective_spec(name: str) -> ObjectiveSpec:
    """The record of a registered objective (resolve refused any other name: ``unknown_objective``)."""
    spec = registered(name)
    if spec is None:
        raise AssertionError(f"unknown objective {name!r}; known: {', '.join(_BY_NAME)}")
    return spec


def objective_of(recipe: Recipe) -> ObjectiveSpec:
    """The record of ``recipe``'s ``train.objective``, its ``train.objective_module`` imported first
    (a checkpoint's recipe read by ``llmft export`` names the module its run imported)."""
    if recipe.train.objective not in _BY_NAME:
        load_objective_module(recipe)
    return objective_spec(recipe.train.objective)


def unknown_objective(recipe: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """``train.objective`` names no registered objective (checked before anything reads its record)."""
    name = recipe.train.objective
    if name in _BY_NAME:
        return []
    module = recipe.train.objective_module
    return [
        Problem(
            where("train.objective"),
            f"'{name}' is not one of {', '.join(_BY_NAME)}"
            + (f" (train.objective_module={module} registered no objective of that name)" if module else ""),
            "Use one of them, or name the module that registers it in train.objective_module "
            '(docs/design.md, "Adding an objective").',
        )
    ]


def reference_kind(recipe: Recipe) -> str:
    """What the run uses as its reference model (one of the constants above)."""
    p, spec = recipe.preference, objective_of(recipe)
    if REFERENCE not in spec.frozen:
        return NO_REFERENCE
    if "preference" in spec.reads and p.loss_type in REFERENCE_FREE_LOSSES:
        return NO_REFERENCE
    if "rl" in spec.reads and recipe.rl.beta == 0:  # online RL without the KL term
        return NO_REFERENCE
    if p.reference != "auto":
        return REFERENCE_MODEL
    return ADAPTERS_DISABLED if recipe.peft.method != "none" else FROZEN_COPY


def objective_problems(recipe: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """What this objective cannot do (yet) with this recipe, in the one order they are reported: not
    built, its head, its record kind, its own checks (``ObjectiveSpec.problems``), then the keys of
    sections it does not read."""
    spec = objective_of(recipe)
    problems: list[Problem] = []
    if spec.runtime is None:
        problems.append(
            Problem(
                where("train.objective"),
                f"{spec.name} ({spec.title}) is not implemented yet",
                f"Use one of {', '.join(s.name for s in objectives() if s.runtime is not None)}.",
            )
        )
    problems += head_problems(spec, recipe, where)
    kind = kind_spec(spec.record)
    if kind.problems:
        problems += load(kind.problems)(spec, recipe, where)
    if spec.problems:
        problems += load(spec.problems)(recipe, where)
    return problems + unread_problems(spec, recipe, where)


def prompt_problems(spec: ObjectiveSpec, recipe: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """Prompt records (online RL): one prompt per row, and room for the completion after it."""
    problems: list[Problem] = []
    if recipe.data.packing:
        problems.append(
            Problem(
                where("data.packing"),
                f"is true, but train.objective={spec.name} reads prompts, which are never packed (each prompt's "
                "completions are generated and scored on their own)",
                "Set data.packing=false.",
            )
        )
    max_seq_len, new = recipe.data.max_seq_len, recipe.rollout.max_new_tokens
    if isinstance(max_seq_len, int) and new >= max_seq_len:
        problems.append(
            Problem(
                where("rollout.max_new_tokens"),
                f"is {new}, which leaves no room for a prompt within data.max_seq_len={max_seq_len} "
                "(a prompt may have data.max_seq_len - rollout.max_new_tokens tokens)",
                "Lower rollout.max_new_tokens below data.max_seq_len, or raise data.max_seq_len.",
            )
        )
    return problems


def head_problems(spec: ObjectiveSpec, recipe: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """What an objective that trains another head than the causal LM's (a reward model's score)
    cannot do."""
    if spec.head == "lm":
        return []
    generate = recipe.train.eval_generate_samples
    found = [
        (  # Liger patches a causal LM's head and loss
            recipe.model.liger_kernels,
            "model.liger_kernels",
            f"is true, but train.objective={spec.name} trains a {spec.head} head, not the causal-LM head "
            "Liger's fused loss replaces",
            "Set model.liger_kernels=false.",
        ),
        (  # a score head generates no text
            generate,
            "train.eval_generate_samples",
            f"is {generate}, but train.objective={spec.name} trains a {spec.head} head, which generates no text",
            "Set train.eval_generate_samples=0 (the eval reports the pair loss and rewards/accuracy).",
        ),
    ]
    return [Problem(where(key), what, fix) for on, key, what, fix in found if on]


def unread_problems(spec: ObjectiveSpec, recipe: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """Each key set away from its default in a section that registered objectives read
    (``ObjectiveSpec.reads``) and ``spec`` reads nothing of: it would be silently ignored."""
    problems = []
    sections = dict.fromkeys(read for s in objectives() for read in s.reads if "." not in read)
    # the exact-match eval's vLLM engine is rollout.vllm's, whatever the objective
    used = {"vllm"} if recipe.train.eval_generate_backend == "vllm" else set()
    for section in sections:
        if spec.reads_from(section) or section in spec.tolerates or not hasattr(recipe, section):
            continue  # a registered section this recipe has not: its module is not the recipe's
        readers = [s for s in objectives() if section in s.reads]
        problems += _unread(spec, recipe, where, section, readers, used if section == "rollout" else set())
    return problems


def _unread(
    spec: ObjectiveSpec,
    recipe: Recipe,
    where: Callable[[str], str],
    section: str,
    readers: list[ObjectiveSpec],
    used: set[str] = frozenset(),  # type: ignore[assignment]
) -> list[Problem]:
    """``section``'s keys set for ``spec``, which does not read it; ``readers``: the objectives that do."""
    reader = " or ".join(s.name for s in readers)
    mine = getattr(recipe, section)
    if not is_dataclass(mine):  # a list (``rewards``): set or not
        if not mine:
            return []
        return [
            Problem(
                where(section),
                f"is set, but train.objective={spec.name} does not read {section}",
                f"Remove it, or set train.objective={reader}.",
            )
        ]
    default = type(mine)()
    whose = readers[0].settings or f"{readers[0].title}'s settings"
    problems = []
    for f in fields(mine):
        if f.name in used:  # read by another part of the run (the eval's engine)
            continue
        value = getattr(mine, f.name)
        if value != getattr(default, f.name):
            problems.append(
                Problem(
                    where(f"{section}.{f.name}"),
                    f"is {value}, but train.objective={spec.name} does not read {section}.* ({whose})",
                    f"Remove it (default {getattr(default, f.name)}), or set train.objective={reader}.",
                )
            )
    return problems


def group_problems(spec: ObjectiveSpec, recipe: Recipe, batch: BatchPlan, where: Callable[[str], str]) -> list[Problem]:
    """A step must hold whole groups (``ObjectiveSpec.group``): the global batch a multiple of G,
    checked once the batch is solved."""
    if spec.group is None:
        return []
    G, g = spec.group_size(recipe), batch.global_batch_size
    if G < 1 or g % G == 0:
        return []
    per_rank = batch.micro_batch_size * batch.dp_size
    fitting = [k * per_rank for k in range(1, 4 * G + 1) if (k * per_rank) % G == 0][:3]
    divisors = [d for d in range(2, g + 1) if g % d == 0][:6]
    return [
        Problem(
            where(spec.group),
            f"is {G}, but the global batch holds {g} {spec.unit} ({batch.equation()}), not a whole number of "
            f"groups of {G}",
            f"Use a batch.global_batch_size that is a multiple of {G} ({', '.join(map(str, fitting))} fit "
            f"micro {batch.micro_batch_size} x {batch.dp_size} rank(s)), or a G dividing {g} "
            f"({', '.join(map(str, divisors))}).",
        )
    ]


def card_text(spec: ObjectiveSpec, recipe: dict) -> str:
    """The objective in a model card's words, from a checkpoint's recipe (plain data): its
    ``card_words`` (its settings after its ``card``), or its ``card``."""
    return load(spec.card_words)(spec, recipe) if spec.card_words else spec.card

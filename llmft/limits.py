"""Every bound llmft puts on what it reads, in one place (docs/reliability.md, "Bounded inputs").

A file, a record, a checkpoint or a model config can be anything a user, a script or a damaged
disk made of it. Each limit here says how much llmft reads, nests, tokenizes or allocates before
it refuses with a message naming the file:line or key and the limit, so that no input ends in a
traceback, an exabyte allocation or an unbounded tokenizer call. Each constant says what it
bounds and why its value is safe for real data; docs/reliability.md lists what each case gets.

This module imports no other llmft module and nothing outside the standard library: the compiler
(plan/) and the data layer read it alike. Besides the bounds, it holds the one check they share
(``nests_deeper``: the depth of a parsed JSON value, without recursion).
"""

from __future__ import annotations

from typing import Any

# --- nesting and text (recipe files, JSONL records, rollout.file) ---------------------------------

# A recipe file's size, read whole before parsing. Recipes are a few KB (a HF config inlined under
# model.config is ~2 KB); 4 MiB holds tens of thousands of data sources. Larger: refused, file named.
RECIPE_MAX_BYTES = 4 << 20
# Levels of mappings and lists in a recipe, counted from the document's top (``model: config: x:``
# is 3), for a file and for an override (the key's parts count as levels). OmegaConf merges
# recursively, ~13 Python frames a level, and dies of RecursionError near 74 levels; real recipes
# nest 2-6 levels. Deeper: refused with file:line (or the override) before OmegaConf sees it.
RECIPE_MAX_DEPTH = 32
# Levels of objects and lists in one JSON record (a training or prompt record, a rollout.file line).
# json.loads and json.dumps recurse (RecursionError near 1000 levels); a chat record with tool calls
# nests ~6 (messages[].tool_calls[].function.arguments{...}). Deeper: one bad record at file:line
# (data.on_bad_record), a rollout.file line refused at file:line.
RECORD_MAX_DEPTH = 100
# Bytes of one JSONL line, one record of a .json file or one rollout.file line. Parsing costs ~3x the
# line; 64 MiB is ~16 M tokens of text, 16x the 1 M-token rows of docs/data.md's long contexts (and only
# the token budget of it is tokenized). Longer: one bad record at file:line (data.on_bad_record), never
# parsed.
RECORD_MAX_BYTES = 64 << 20
# A .json data file is one JSON document, parsed whole (~5x its size in memory); the largest known
# real ones are ~2 GB (OpenHermes-2.5). Larger: refused, naming the file; JSONL is read line by line.
JSON_FILE_MAX_BYTES = 4 << 30
# Tokens past a token limit that a text cut before tokenizing still holds (encode.py ``cut``): a text
# is cut to (limit + CUT_MARGIN) x the longest vocabulary entry characters, so the word the cut splits
# lies beyond the first ``limit`` tokens, which equal the uncut text's (tests/unit/test_input_bounds.py).
CUT_MARGIN = 64
# Characters of text per tokenizer call: the tokenizer returns a Python list (ids; and a tuple of
# offsets for chat masking) per token, ~40-170 bytes a token, alive until the call's records are
# arrays. 1M characters bounds that to ~0.2 GB, or to one record's where a record is longer (and a
# record's texts are cut to the token budget first).
CALL_CHARS = 1 << 20

# --- model configs (config.json arithmetic, before anything is allocated) -------------------------

# A model's config.json, read whole (by llmft's check, then by transformers). Real ones are 1-60 KB
# (a classifier's id2label of 100k labels ~3 MB). Larger: refused, naming the file.
CONFIG_MAX_BYTES = 16 << 20
# Levels of objects and lists in a config.json; json.loads recurses (RecursionError near 1000).
# Real configs nest 3-4 (text_config.rope_scaling.{...}). Deeper: refused, naming the file.
CONFIG_MAX_DEPTH = 32
# Each width, count and vocabulary field of a config (hidden_size, heads, head_dim, intermediate_size,
# vocab_size, experts): a whole number in [1, this] (expert counts may be 0). The largest published
# values are ~2**18 (Gemma 3's vocabulary, 262144; Llama 3.1 405B's intermediate_size is 53248);
# 2**24 is 64x that. Beyond: refused, naming the field.
MODEL_SIZE_MAX = 1 << 24
# num_hidden_layers / n_layer / num_layers: the deepest published models have ~126-200 layers; 2**14
# is 80x that. transformers builds per-layer lists of this length (layer_types) with the config: a
# typo of 2**24 layers took 51 s and GBs before anything else. Beyond: refused, naming the field.
MODEL_LAYERS_MAX = 1 << 14
# max_position_embeddings / n_positions: the longest published context is ~10M tokens (Llama 4
# Scout, 10485760 < 2**24); 2**28 is 25x that. A learned position table is max_positions x hidden.
MODEL_POSITIONS_MAX = 1 << 28
# Parameters a config describes (an upper bound: every layer dense and with all its experts, a learned
# position table, an untied head). The largest published models hold ~2e12; 1e13 parameters are
# 20 TB in bf16, more than any one machine's memory: certainly a typo. Beyond: refused, naming the
# fields that make it, before anything is allocated.
MODEL_PARAMS_MAX = 10**13
# Parameters a model directory's config.json may describe per byte of the weight files beside it (a
# lower bound on its parameters: embedding, MLP matrices, attention output). 1-bit quantization
# stores 8 a byte; real checkpoints 0.25-2. More: the config has a typo or is another model's
# (building it would allocate what it says, GBs for a 460 KB model): refused, naming the file.
PARAMS_PER_WEIGHT_BYTE_MAX = 16

# --- reward workers and the code sandbox (llmft/scoring, docs/rl.md "Rewards that cannot hang") -----

# A reward call's deadline when its entry sets no rewards[].timeout_s (with rl.reward_workers >= 1).
# Real reward functions answer in milliseconds; math-verify gives up on its own after 5 s per
# parse and per comparison; a code_tests call runs a few short test processes.
REWARD_TIMEOUT_S = 60.0
# How long a reward worker may take to start (python, the sandbox, importing the user's module,
# sympy for math_verify) before the run stops naming it; not counted in any call's deadline.
REWARD_WORKER_START_S = 120.0
# Bytes of one reply line from a worker (a float, or a wrong value's repr cut to REWARD_REPR_CHARS);
# more is a broken worker, killed and counted as a failure.
REWARD_REPLY_MAX_BYTES = 1 << 20
REWARD_REPR_CHARS = 200
# Size of a sandboxed worker's private /tmp (a tmpfs: memory). A reward's scratch files fit; more
# is ENOSPC inside the sandbox.
REWARD_WORKER_TMP_BYTES = 256 << 20
# code_tests: each test of a completion runs in its own process with these bounds. Address space:
# the interpreter (~30 MB) and what a test solution builds; wall and CPU seconds per test (less when
# rewards[].timeout_s divided over the record's tests is less); bytes of any file written (stdout
# included) and of its private /tmp; tests per record.
CODE_TESTS_MEMORY_BYTES = 1 << 30
CODE_TESTS_TEST_S = 10.0
CODE_TESTS_FILE_BYTES = 16 << 20
CODE_TESTS_TMP_BYTES = 64 << 20
CODE_TESTS_MAX_TESTS = 256

# --- checkpoints (objective/ state files) ---------------------------------------------------------


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether the parsed JSON ``value`` nests objects and lists more than ``limit`` levels (a loop,
    not recursion: the value may be as deep as its parser allowed)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, (dict, list)))
    return False

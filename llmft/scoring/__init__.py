"""Where reward functions run: worker processes with deadlines (``pool``), the bubblewrap sandbox
(``sandbox``), the worker's side (``worker``) and the built-in rewards (``builtin_rewards``).

Nothing here imports torch or another llmft package: a worker starts in a fraction of a second, and
the recipe check (``plan/``) asks ``sandbox`` whether bubblewrap works on this machine.
"""

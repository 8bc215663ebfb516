"""Agents: multi-turn episodes with environments and tools, one module per concern.

- ``env``: the environment interface (``reset`` / ``step`` / ``close``, ``StepResult``), its
  registry and the checks of what an environment returns.
- ``tools``: the tool interface, the call formats (``json``, ``compact``) and ``ToolEnvironment``.
- ``limits``: finish reasons and the turn / token limits.
- ``pool``: where environments run — Ray worker actors (``RayEnvPool``) or this process
  (``LocalEnvPool``) — with per-call timeouts and failures contained to their sample.
- ``episode``: one sample's episode over an append-only token list, with its loss mask.
- ``calc``, ``guess``: the two tasks (a calculator tool; a number-guessing game).
- ``experts``, ``sft``, ``evaluate``, ``warm_start``: the tasks' scripted transcripts, the
  multi-turn supervised warm start, greedy multi-turn evaluation and their measurement.
- ``config``: the ``agent`` config block's pool and limits.
- ``workflow``: many episodes driven together against a batch generator, the token-exactness check.

The RL loop runs these episodes for a run with an ``agent`` block (``workflow``; docs/agents.md).
"""

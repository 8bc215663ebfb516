"""A rollout engine that fails mid-run, for tests: real vLLM (``VLLMRolloutEngine``) whose replica 0
raises at its second ``generate`` — the run's first batch is generated, the next is not. A config
names it ``rollout.engine: engine_faults:VLLMFailingMidRun`` (``tests/`` on the PYTHONPATH of the
driver, which the job carries to the actors)."""
from __future__ import annotations

from rlhf_switch.engines.vllm_rollout import VLLMRolloutEngine

MESSAGE = "generate refused by the test's fault (replica 0, second call)"


class VLLMFailingMidRun(VLLMRolloutEngine):
    @classmethod
    def build(cls, ctx):
        self = super().build(ctx)
        self.replica, self.calls = ctx.replica, 0
        return self

    def generate(self, prompts, max_new_tokens, temperature, seeds, stop_ids):
        self.calls += 1
        if self.replica == 0 and self.calls == 2:
            raise RuntimeError(MESSAGE)
        return super().generate(prompts, max_new_tokens, temperature, seeds, stop_ids)

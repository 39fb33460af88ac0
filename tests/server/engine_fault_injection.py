"""Fault injection for tests only: runs `jaxllm serve ARGS` with `LLMEngine.step` made to raise on purpose,
so that tests/server/test_engine_failure.py can watch a real server meet an engine failure. Nothing in
jaxllm reads or imports this file.

    python tests/server/engine_fault_injection.py STEPS serve [flags]

The step raises once two requests have been running together for STEPS steps (counted by the engine's own
stats before each step), so both are in flight, and a stream has had its first tokens, whatever the speed.
"""

from __future__ import annotations

import sys

INJECTED = "injected engine fault"  # in the exception's message: the tests look for it


def fail_after_two_running_for(steps: int) -> None:
    from jaxllm.engine.llm_engine import LLMEngine

    real_step = LLMEngine.step
    together = 0

    def step(self):
        nonlocal together
        if self.get_stats().num_requests_running >= 2:
            together += 1
            if together > steps:
                raise RuntimeError(f"{INJECTED} after {steps} steps with two requests running")
        return real_step(self)

    LLMEngine.step = step


if __name__ == "__main__":
    fail_after_two_running_for(int(sys.argv[1]))
    from jaxllm.server.cli import main

    main(sys.argv[2:])

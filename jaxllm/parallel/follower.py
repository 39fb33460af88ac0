"""Leader and followers: process 0 schedules, every other process replays its steps.

    process 0:   LLMEngine.step(): schedule() -> StepChannel.publish(SchedulerOutput) -> runner.execute
    process k>0: follow(engine):   StepChannel.receive() -> runner.execute (same inputs, same collectives)

A step's message is the plain SchedulerOutput (jaxllm/scheduler_output.py): new requests once, then
per-step deltas, never the scheduler's Requests. Each follower's runner builds the same per-request state
from the same messages as the leader's (runner/request_state.py), so a decode step of N requests
publishes O(N) small values whatever their lengths.

The channel is jax.distributed's key-value store (the coordinator that `initialize_distributed` joined):
step s is stored under "jaxllm/step/s" as a pickle of that SchedulerOutput. The leader deletes
step s - 2 when it publishes step s: every follower has read it by then, since step s - 1's collectives
could not finish without them. `stop()` publishes None and the followers return.
Both sides must build the engine with the same config (so buckets and KV cache size agree).
"""

from __future__ import annotations

import pickle

_PREFIX = "jaxllm/step/"
_WAIT_MS = 60_000


def _client():
    from jaxllm.compat import distributed_client

    client = distributed_client()
    if client is None:
        raise ValueError("a step channel needs jax.distributed (num_processes > 1)")
    return client


class StepChannel:
    def __init__(self):
        self.client = _client()
        self.step = 0

    def publish(self, sched) -> None:
        self.client.key_value_set_bytes(f"{_PREFIX}{self.step}", pickle.dumps(sched))
        if self.step >= 2:
            self.client.key_value_delete(f"{_PREFIX}{self.step - 2}")
        self.step += 1

    def stop(self) -> None:
        self.publish(None)

    def receive(self):
        """The next step's SchedulerOutput, or None once the leader stopped. Waits while the leader idles."""
        key = f"{_PREFIX}{self.step}"
        while True:
            try:
                raw = self.client.blocking_key_value_get_bytes(key, _WAIT_MS)
                break
            except Exception as e:  # the store reports a wait that ran out as an error; keep waiting
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self.step += 1
        return pickle.loads(raw)


def lead(engine) -> StepChannel:
    """Make process 0's engine publish every step it schedules."""
    engine.step_channel = StepChannel()
    return engine.step_channel


def follow(engine) -> int:
    """Replay the leader's steps on this process's devices until it stops; returns the steps replayed."""
    channel = StepChannel()
    steps = 0
    while (sched := channel.receive()) is not None:
        with engine.tp.context():
            engine.runner.execute(sched)
        steps += 1
    return steps

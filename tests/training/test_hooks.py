"""Hooks run on their cadence, in the order added, `before` ahead of the step and `run` after it;
record hooks see each record on theirs."""

from megascale_jax.training.hooks import Hooks


def drive(hooks: Hooks, last: int) -> list[tuple]:
    """The loop's calls for steps 1..last, with each step's record arriving one step late."""
    for step in range(1, last + 1):
        hooks.before_step(step)
        hooks.after_step(step, f"state{step}")
        if step > 1:
            hooks.on_record({"step": step - 1})
    hooks.on_record({"step": last})


def test_step_hooks_run_on_their_cadence_in_order_and_at_the_last_step():
    calls = []
    hooks = Hooks(last=10)
    hooks.add("evaluate", 4, lambda step, state: calls.append(("evaluate", step, state)))
    hooks.add("profile", 3, lambda step, state: calls.append(("profile", step, state)),
              before=lambda step: calls.append(("start trace", step)), at_last=False)
    hooks.add("checkpoint", 0, lambda step, state: calls.append(("checkpoint", step, state)))  # never... but the last
    drive(hooks, 10)
    assert calls == [
        ("start trace", 3), ("profile", 3, "state3"),
        ("evaluate", 4, "state4"),
        ("start trace", 6), ("profile", 6, "state6"),
        ("evaluate", 8, "state8"),
        ("start trace", 9), ("profile", 9, "state9"),
        ("evaluate", 10, "state10"), ("checkpoint", 10, "state10"),
    ]
    assert hooks.due(8) == ["evaluate"] and hooks.due(10) == ["evaluate", "checkpoint"] and hooks.due(7) == []


def test_record_hooks_see_each_due_record_once():
    seen = {"all": [], "log": []}
    hooks = Hooks(last=7)
    hooks.add_record("all", 1, lambda r: seen["all"].append(r["step"]))
    hooks.add_record("log", 3, lambda r: seen["log"].append(r["step"]))
    drive(hooks, 7)
    assert seen == {"all": [1, 2, 3, 4, 5, 6, 7], "log": [3, 6, 7]}

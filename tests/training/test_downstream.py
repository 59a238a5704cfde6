"""`train.eval_tasks` at start-up (training/downstream.prepare): the run's own tokenizer makes each
task's requests, and a task file that cannot be scored is one warning and left out (a mistake in
an evaluation does not stop a training run). The scores themselves: tests/evaluation/test_in_loop.py
and tests/parallel/test_pipeline.py."""

import json

from megascale_jax.config import load_config
from megascale_jax.training import downstream
from megascale_jax.training.tokenizer import byte_tokenizer


class Said:
    """The module's logger, kept: whether pytest's caplog sees it depends on what set up the
    package's logging earlier in the same worker (cli.setup_logging stops propagation)."""

    def __init__(self):
        self.warnings, self.infos = [], []

    def warning(self, line):
        self.warnings.append(line)

    def info(self, line):
        self.infos.append(line)


def test_task_files_that_cannot_be_scored_are_one_warning_each_and_left_out(tmp_path, monkeypatch):
    good = tmp_path / "mc.jsonl"
    good.write_text("".join(json.dumps({"context": c, "choices": ["yes", "no!"], "gold": 1}) + "\n"
                            for c in ("Is it", "Was it", "x" * 40)))
    (tmp_path / "broken.jsonl").write_text('{"context": "Q", "choices": ["a"], "gold": 0}\n{"context": \n')
    (tmp_path / "empty.jsonl").write_text("")
    paths = [good, tmp_path / "missing.jsonl", tmp_path / "broken.jsonl", tmp_path / "empty.jsonl", good]
    cfg = load_config(None, ["model.seq_len=32", f"train.eval_tasks=[{','.join(map(str, paths))}]"])
    said = Said()
    monkeypatch.setattr(downstream, "logger", said)
    prepared = downstream.prepare(cfg, None)
    warned = said.warnings
    assert len(warned) == 4 and all(w.endswith("that task is not scored, training goes on") for w in warned), warned
    assert "missing.jsonl does not exist" in warned[0] and "broken.jsonl:2" in warned[1]
    assert "empty.jsonl" in warned[2] and "a task named 'mc' is listed already" in warned[3]
    (mc,) = prepared
    assert mc.task.name == "mc" and len(mc.requests) == 6  # two choices an item
    # the byte-level run's ids: each continuation " " + choice is its UTF-8 bytes, after the context's
    first = mc.requests[0]
    assert list(first.continuation) == list(b" yes") and list(first.context) == list(b"Is it")
    assert byte_tokenizer().encode("Is it").ids == list(b"Is it")
    # a context longer than model.seq_len is cut from the left, as lm-eval cuts it: counted
    assert mc.truncated == 2
    assert said.infos == ["downstream: mc (3 items, 6 requests, 2 cut to model.seq_len); scored at the last step"]

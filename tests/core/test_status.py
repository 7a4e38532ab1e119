"""The status channel (holmes_jax.core.status): events written by a worker, checked by the
launcher before the supervisor acts on them."""

import io
import json
import math
import os
import sys

import pytest

from holmes_jax.cluster.launcher import Launch, Worker
from holmes_jax.core import status


@pytest.fixture
def channel(monkeypatch):
    """A pipe as this process's channel: yields the read end's file."""
    read_end, write_end = os.pipe()
    monkeypatch.setenv(status.STATUS_FD_VAR, str(write_end))
    monkeypatch.setattr(status, "_channel", None)
    monkeypatch.setattr(status, "_closed", False)
    with open(read_end) as reader:
        yield reader
    if status._channel is not None:
        status._channel.close()


def test_reported_events_arrive_as_one_json_line_each(channel):
    status.report("run_dir", path="/runs/a")
    status.report("compiled", seconds=1.25, detail="compilation cache: hit")
    status.report("step", step=7)
    status._channel.close()
    lines = channel.read().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"event": "run_dir", "path": "/runs/a"},
        {"event": "compiled", "seconds": 1.25, "detail": "compilation cache: hit"},
        {"event": "step", "step": 7},
    ]
    assert all(status.parse(x) == (json.loads(x), "") for x in lines)


def test_a_descriptor_that_is_not_a_pipe_is_left_alone(monkeypatch, tmp_path):
    """An inherited variable naming some other open file: nothing is written to it, and
    the variable is gone for the processes this one starts."""
    with open(tmp_path / "other", "w") as other:
        monkeypatch.setenv(status.STATUS_FD_VAR, str(other.fileno()))
        monkeypatch.setattr(status, "_channel", None)
        monkeypatch.setattr(status, "_closed", False)
        status.report("step", step=1)
        assert status._closed and status.STATUS_FD_VAR not in os.environ
    assert (tmp_path / "other").read_text() == ""


def test_without_a_channel_report_writes_nothing(monkeypatch):
    monkeypatch.delenv(status.STATUS_FD_VAR, raising=False)
    monkeypatch.setattr(status, "_channel", None)
    monkeypatch.setattr(status, "_closed", False)
    status.report("step", step=1)
    assert status._channel is None and status._closed


MEASURED = {"event": "measured", "excluded": ["roce-1"], "plans": ["data=4"], "step_s": [0.4]}


@pytest.mark.parametrize(
    "record, problem",
    [
        ([1], "must be a JSON object, not list"),
        ({"event": "stop"}, "event 'stop' is not one of"),
        ({"event": "step"}, "step.step=None: must be int"),
        ({"event": "step", "step": True}, "step.step=True: must be int"),
        ({"event": "step", "step": 0}, "step.step=0: must be >= 1"),
        ({"event": "resumed", "step": -1}, "resumed.step=-1: must be >= 0"),
        ({"event": "step", "step": 3, "loss": 1.0}, "unknown field(s) ['loss'] for event 'step'"),
        ({"event": "compiled", "seconds": math.nan, "detail": ""}, "must be finite"),
        ({"event": "run_dir", "path": 5}, "run_dir.path=5: must be str"),
        (dict(MEASURED, plans="data=4"), "measured.plans='data=4': must be list"),
        (dict(MEASURED, plans=["a", "b"]), "2 plans and 1 step times"),
        (dict(MEASURED, plans=[], step_s=[]), "must be 1 to 64 plans"),
        (dict(MEASURED, plans=[""]), "must be plan descriptions"),
        (dict(MEASURED, step_s=[0]), "finite and > 0"),
        (dict(MEASURED, step_s=[True]), "finite and > 0"),
        (dict(MEASURED, step_s=[math.inf]), "finite and > 0"),
        (dict(MEASURED, excluded=[]), "must be the lost hosts' names"),
        (dict(MEASURED, excluded=[3]), "must be the lost hosts' names"),
    ],
)
def test_a_malformed_event_is_named(record, problem):
    assert problem in status.check(record)


def test_a_measured_event_carries_one_time_per_plan():
    assert status.check(MEASURED) == ""
    assert status.check(dict(MEASURED, plans=["data=4 m=1", "data=4 m=2"], step_s=[0.4, 1])) == ""


def test_report_refuses_an_event_it_would_send_malformed(channel):
    with pytest.raises(ValueError, match=r"status event .*step.step=0: must be >= 1"):
        status.report("step", step=0)


def test_parse_refuses_what_is_not_json_or_too_long():
    assert status.parse("step 3 | loss 1.0")[1].startswith("not JSON")
    too_long = json.dumps({"event": "run_dir", "path": "x" * status.MAX_LINE})
    assert status.parse(too_long) == (None, f"a line of {len(too_long)} characters (at most "
                                            f"{status.MAX_LINE})")  # fmt: skip


# A worker that writes a garbage line, an over-long one, then two good events.
WRITER = r"""
import os
from holmes_jax.core.status import MAX_LINE, report
with os.fdopen(int(os.environ["HOLMES_STATUS_FD"]), "w", closefd=False) as f:
    f.write("step 2 | loss 1.0\n")
    f.write("{" + "x" * (2 * MAX_LINE) + "\n")
report("run_dir", path="/runs/x")
report("step", step=2)
"""


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_the_launcher_passes_good_events_on_and_names_each_bad_line():
    seen = []
    out = io.StringIO()
    worker = Worker("h0", 0, [sys.executable, "-c", WRITER], dict(os.environ))
    code = Launch([worker], out=out, status=lambda w, e: seen.append((w.host, e))).run()
    assert code == 0, out.getvalue()
    assert seen == [("h0", {"event": "run_dir", "path": "/runs/x"}),
                    ("h0", {"event": "step", "step": 2})]  # fmt: skip
    ignored = [x for x in out.getvalue().splitlines() if "status line ignored" in x]
    assert ignored == [
        "launch: h0 (process 0): status line ignored: not JSON (Expecting value: line 1 "
        "column 1 (char 0))",
        f"launch: h0 (process 0): status line ignored: a line over {status.MAX_LINE} characters",
    ]

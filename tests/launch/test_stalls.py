"""Slow dependencies are visible: a reward server that does not answer logs one line per retry with
its URL and attempt (`rl_rollout.remote`), and a generation call that keeps the driver waiting
past `health.engine_stall_warn_s` prints a console line naming the engine and its log's last line.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import sys
import threading
import time

import pytest

from rl_rollout.remote import RemoteRewardClient, RemoteRewardError
from tests.launch.fakes import fake_run, use_fake_ray
from tests.launch.test_step_loop import config


class _Hanging(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        time.sleep(2.0)  # longer than the client's timeout


@contextlib.contextmanager
def hanging_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hanging)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/reward"
    finally:
        server.shutdown()
        server.server_close()


def test_a_hanging_reward_server_logs_one_line_per_retry_with_its_url_and_attempt(caplog):
    with hanging_server() as url, caplog.at_level(logging.WARNING, logger="rl_rollout.remote"):
        client = RemoteRewardClient(url, batch_size=4, timeout_s=0.2, max_retries=2, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match="gave up after 3 attempts"):
            client(["q"] * 4, ["p"] * 4, [None] * 4)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2  # two retries; the third failure is the error itself
    for attempt, line in enumerate(lines, start=1):
        assert f"attempt {attempt}: no answer from {url} within 0.2 s; retry {attempt} of 2 in" in line


def test_a_generation_that_stalls_prints_a_line_naming_the_engine_and_its_log(monkeypatch, tmp_path):
    use_fake_ray(monkeypatch)
    run = fake_run(config(**{"train.max_steps": 1, "health.engine_stall_warn_s": 0.5}))
    (tmp_path / "engine-0.log").write_text("engine-0: pid 1\nreward server: attempt 2 of 4: no answer\n")
    lines: list[str] = []
    run.rollouts.notify, run.rollouts.log_dir = lines.append, str(tmp_path)
    fake_ray = sys.modules["ray"]
    real_wait, waits = fake_ray.wait, []

    def wait(futures, num_returns=1, timeout=None):  # the first two generation waits time out
        if timeout == 0.5:  # the warning period (the weight sync's and other calls' deadlines differ)
            waits.append(timeout)
            if len(waits) <= 2:
                return [], list(futures)
        return real_wait(futures, num_returns=num_returns, timeout=timeout)

    monkeypatch.setattr(fake_ray, "wait", wait)
    run.fit()
    assert waits == [0.5, 0.5, 0.5]
    log = tmp_path.resolve() / "engine-0.log"
    assert lines == [
        f"warning: generation has waited {waited} s on engine-0 (health.engine_stall_warn_s = 0.5); "
        f"last line of {log}: reward server: attempt 2 of 4: no answer"
        for waited in (0.5, 1)
    ]
    assert run.tracker.steps() == [1]


def test_a_generation_past_engine_stall_stop_s_stops_the_run_naming_the_engine(monkeypatch, tmp_path):
    from rl_launch.health import HealthError

    use_fake_ray(monkeypatch)
    stall = {"health.engine_stall_warn_s": 0.5, "health.engine_stall_stop_s": 1.0}
    # with engine restarts (test_engine_restart): the hung engine is restarted instead
    run = fake_run(config(**{"train.max_steps": 1, "rollout.engine_restarts": 0, **stall}))
    (tmp_path / "engine-0.log").write_text("engine-0: pid 1\nstuck in the reward\n")
    lines: list[str] = []
    run.rollouts.notify, run.rollouts.log_dir = lines.append, str(tmp_path)
    fake_ray = sys.modules["ray"]
    monkeypatch.setattr(fake_ray, "wait", lambda futures, num_returns=1, timeout=None: ([], list(futures)))
    with pytest.raises(HealthError) as stopped:
        run.fit()  # before: a warning line every 0.5 s, forever
    log = tmp_path.resolve() / "engine-0.log"
    assert str(stopped.value).startswith(
        f"generation has waited 1 s on engine-0 (health.engine_stall_stop_s = 1); "
        f"last line of {log}: stuck in the reward: the run stops"
    )
    assert "and rollout.engine_restarts is 0 (a hung engine is not restarted)" in str(stopped.value)
    assert lines == [
        f"warning: generation has waited 0.5 s on engine-0 (health.engine_stall_warn_s = 0.5); "
        f"last line of {log}: stuck in the reward"
    ]

"""The Python executable of the tests' Ray workers (`worker_zygote`), run as
`python -I -S worker_shim.py <zygote socket> <default_worker.py> <its arguments>`.

The raylet starts it where it would start `python default_worker.py ...`. It hands its command line,
environment, folder and standard streams to the zygote, which forks the worker; then it stands for
that worker towards the raylet: the signals it gets go to the worker, and it exits as the worker
does (a signal's death by the same signal). When the zygote cannot serve it (not running, another
Python, environment or namespace: a node of test_multinode's in a network namespace of its own), it
becomes `python default_worker.py ...` itself. Standard library
only: without `site` it starts in ~20 ms.
"""

import json
import os
import signal
import socket
import sys
import time

ANSWER_TIMEOUT_S = 30  # a zygote that does not answer in time is passed over
START_TIMEOUT_S = 30  # nor one that was started (worker_zygote.STARTING) but does not listen by then

FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def _ask(path: str, argv: list) -> tuple:
    """(the connection's reader, the zygote's answer) for this worker, or (None, the reason the
    zygote cannot serve it)."""
    folder, deadline = os.path.dirname(path), time.monotonic() + START_TIMEOUT_S
    while (
        not os.path.exists(path)
        and os.path.exists(os.path.join(folder, "starting"))
        and not os.path.exists(os.path.join(folder, "failed"))
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)  # the zygote is importing
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(ANSWER_TIMEOUT_S)
    try:
        connection.connect(path)
        namespaces = {name: os.readlink(f"/proc/self/ns/{name}") for name in os.listdir("/proc/self/ns")}
        request = json.dumps(
            {
                "argv": argv,
                "env": dict(os.environ),
                "cwd": os.getcwd(),
                "python": sys.executable,
                "namespaces": namespaces,
            }
        ).encode()
        socket.send_fds(connection, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
        reader = connection.makefile("rb")
        answer = json.loads(reader.readline() or b'{"fallback": "no answer"}')
        connection.settimeout(None)  # the worker's end comes when it comes
    except (OSError, ValueError) as error:
        connection.close()
        return None, {"fallback": repr(error)}
    return reader, answer


def _stand_for(reader, pid: int) -> None:
    """Forward signals to the worker `pid` until the zygote reports its end; exit as it did."""
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, lambda number, _frame: os.kill(pid, number))
    line = reader.readline()
    code = json.loads(line)["exit"] if line else 1
    if code < 0:
        if -code in FORWARDED_SIGNALS:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def main() -> None:
    path, argv = sys.argv[1], sys.argv[2:]
    reader, answer = _ask(path, argv)
    if reader is None or "pid" not in answer:
        try:
            with open(os.path.join(os.path.dirname(path), "fallbacks.log"), "a") as log:
                log.write(f"{os.getpid()}: {answer.get('fallback')}\n")
        except OSError:
            pass  # a log the worker does not need
        os.execv(sys.executable, [sys.executable, *argv])
    _stand_for(reader, answer["pid"])


if __name__ == "__main__":
    main()

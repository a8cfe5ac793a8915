"""The fork server of ``tests/distributed_harness.py``'s workers (a zygote): a script.

``run_workers`` starts it once per test session (``python worker_zygote.py FD``, ``FD``
one end of a socket pair, a ``multiprocessing.connection.Connection``). It receives the
parent's ``sys.path`` and a list of modules, imports them once (torch, seqpipe, ...: 2-3 s
of CPU that each worker would otherwise spend), then serves launches: per worker it
``os.fork()``s, and the child leaves the serve loop and runs the worker at this script's
top level. The worker so ends the way a user's script under torchrun ends, through the
interpreter's whole teardown (``Py_FinalizeEx``: exit handlers, module finalization, the
collection of what is left, C++ destructors): an abort there is the worker's exit status,
which the zygote reports to the parent (multiprocessing's ``forkserver`` ends a child with
``os._exit``, which would have hidden it).

Protocol (tuples over the connection)::

    parent -> zygote  (sys_path, preload)                      once, first
    parent -> zygote  ("start", launch, common, jobs)          common: env, cwd, sys.path
    zygote -> parent  ("started", launch, pids)                one pid per job, in order
    zygote -> parent  ("exited", launch, pid, exit_code)       as each is reaped
    parent -> zygote  ("kill", launch)                         SIGKILL those not reaped yet

``exit_code`` is ``os.waitstatus_to_exitcode``'s: ``-N`` for signal ``N``. The zygote reaps
every child it forked (a pidfd per child says when it ended), ignores SIGINT (a Ctrl-C
reaches the workers and the parent, and the parent's end closes the connection), and when
the connection closes (the test session ended or died) kills the children still running,
reaps them and exits.
"""
from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Dict, List, Optional, Tuple

Job = Tuple[Dict[str, Any], bytes, str, str]  # (common, payload, error_file, done_file)


def _preload(conn: Connection) -> None:
    sys_path, modules = conn.recv()
    sys.path[:] = sys_path
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # not installed here: a worker that needs it imports it (and fails) itself


def _serve(conn: Connection) -> Optional[Job]:
    """Serve launches until the connection closes (then return None, in the zygote).

    In a forked child it returns that child's job instead: the child runs it at the
    script's top level and ends there."""
    children: Dict[int, Tuple[int, int]] = {}  # pidfd -> (pid, launch)
    while True:
        for ready in wait([conn, *children]):
            if ready is not conn:
                pid, launch = children.pop(ready)
                os.close(ready)
                _, status = os.waitpid(pid, 0)
                conn.send(("exited", launch, pid, os.waitstatus_to_exitcode(status)))
                continue
            try:
                message = conn.recv()
            except EOFError:  # the parent's end closed: the session is over
                for pidfd, (pid, _) in children.items():
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    os.close(pidfd)
                return None
            if message[0] == "kill":
                for pid, launch in children.values():
                    if launch == message[1]:
                        os.kill(pid, signal.SIGKILL)  # not reaped yet: the pid is still its
                continue
            _, launch, common, jobs = message
            pids: List[int] = []
            for payload, error_file, done_file in jobs:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    for pidfd in children:
                        os.close(pidfd)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    return common, payload, error_file, done_file
                children[os.pidfd_open(pid)] = (pid, launch)
                pids.append(pid)
            conn.send(("started", launch, pids))


def _run(job: Job) -> None:
    """A worker: the parent's environment, then its pickled ``entry(*args)``. An exception's
    traceback goes to ``error_file`` for the parent's failure message, and on up: the
    interpreter prints it and exits with status 1, through its teardown as always."""
    common, payload, error_file, done_file = job
    os.environ.clear()
    os.environ.update(common["env"])
    os.chdir(common["cwd"])
    sys.path[:] = common["sys_path"]
    try:
        entry, args = pickle.loads(payload)
        entry(*args)
    except Exception:
        with open(error_file, "w") as file:
            file.write(traceback.format_exc())
        raise
    open(done_file, "w").close()  # the function returned: what follows is the teardown


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    connection = Connection(int(sys.argv[1]))
    _preload(connection)
    worker = _serve(connection)
    if worker is not None:
        _run(worker)
    # A worker ends here, as a script ends: sys.exit's status, then Py_FinalizeEx in full.

"""``python ARGS`` as a fresh interpreter would run it, without starting one (each imports torch anew: 3-4 CPU-s).

``run_as_python`` forks the command from tests/dist_harness.py's forkserver, which has torch and the project
imported already, and runs it there as ``python`` would: its own ``sys.argv``, the ``sys.path`` of a fresh
interpreter (the script's directory first, not the repository root; ``-m``: the working directory), the given
working directory and environment, fds 1 and 2 to files, ``__main__`` run by runpy, an uncaught exception printed as
a traceback with exit code 1, ``SystemExit`` as the exit code, atexit handlers run. The project's own modules are
dropped from the forked process first, so the script imports them itself, through its own ``sys.path`` (a script
that cannot find them fails here as it would for a user). ``forked_python`` is the tests' door: ``train.py`` as
``train.main`` on a forked rank, any other script through ``run_as_python``.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def _fresh_sys_path(pythonpath: str, cwd: str) -> Tuple[str, ...]:
    """``sys.path`` of a fresh interpreter started in ``cwd`` with this ``PYTHONPATH``, after its first entry (the
    script's directory)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"PYTHONPATH": pythonpath} if pythonpath else {})
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"], cwd=cwd,
                         env=env, capture_output=True, text=True, check=True).stdout
    return tuple(json.loads(out))


# What ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) does after start-up, run in a process forked from the
# preloaded forkserver (a string given to ``exec``: the child imports nothing to find it). ARGS: (the repository
# root, the working directory, the command after ``python``, the environment, sys.path after its first entry, the
# stdout and stderr files).
_AS_PYTHON_RUNS_IT = r"""
import atexit, itertools, multiprocessing.process, os, runpy, sys, threading, traceback
root, cwd, command, env, fresh_path, out_file, err_file = ARGS
for fd, name in ((1, out_file), (2, err_file)):
    f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(f, fd)
    os.close(f)
os.chdir(cwd)
os.environ.clear()
os.environ.update(env)
if "torch" in sys.modules and env.get("OMP_NUM_THREADS", "").isdigit():  # what torch's import reads from it
    sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
mp = multiprocessing.process  # a main process, as in a fresh interpreter (for a script that starts workers)
me = mp.current_process()
me._identity, me._name, me._parent_pid = (), "MainProcess", None
me._config.pop("daemon", None)
mp._parent_process, mp._children, mp._process_counter = None, set(), itertools.count(1)
def ours(module):
    try:
        places = [getattr(module, "__file__", None)]
        path = getattr(module, "__path__", None)
        if isinstance(path, list) or type(path).__name__ == "_NamespacePath":
            places += list(path)
        return any(isinstance(p, str) and p.startswith(root + os.sep) for p in places)
    except Exception:
        return False
for name, module in list(sys.modules.items()):  # the project's modules: the script imports them itself
    if ours(module):
        del sys.modules[name]
try:
    if command[0] == "-m":
        sys.path[:] = [os.getcwd(), *fresh_path]
        sys.argv = ["-m", *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(command[0])
        sys.path[:] = [os.path.dirname(os.path.realpath(script)), *fresh_path]
        sys.argv = list(command)
        runpy.run_path(script, run_name="__main__")
    code = 0
except SystemExit as e:
    code = 0 if e.code is None else e.code
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
except BaseException:
    traceback.print_exc()
    code = 1
threading._shutdown()  # the interpreter's exit: its threads joined, then the atexit handlers
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""
_START = threading.Lock()  # processes are started one at a time (the forkserver's connection)


def run_as_python(command: List[str], cwd: Path, env: Dict[str, str],
                  timeout: float) -> Tuple[subprocess.CompletedProcess, bool]:
    """``python COMMAND`` (a script and its arguments, or ``-m module ...``) in ``cwd`` with ``env``, forked from
    tests/dist_harness.py's forkserver as the module docstring says: (exit code, stdout and stderr as a
    CompletedProcess; whether it ran past ``timeout`` seconds: then it got SIGTERM, and SIGKILL 60 s later)."""
    from tests.dist_harness import _context

    with tempfile.TemporaryDirectory(prefix="as-python-") as streams:  # not under the caller's tmp_path
        out_file, err_file = os.path.join(streams, "stdout"), os.path.join(streams, "stderr")
        child_args = (str(ROOT), str(cwd), list(command), dict(env),
                      list(_fresh_sys_path(env.get("PYTHONPATH", ""), str(cwd))), out_file, err_file)
        p = _context().Process(target=exec, args=(_AS_PYTHON_RUNS_IT, {"ARGS": child_args}))
        with _START:
            p.start()
        p.join(timeout)
        late = p.exitcode is None
        if late:  # it started real work: SIGTERM first (bench_cluster.py removes namespaces)
            p.terminate()
            p.join(60)
            if p.exitcode is None:
                p.kill()
                p.join()
        with open(out_file, errors="replace") as f:
            out = f.read()
        with open(err_file, errors="replace") as f:
            err = f.read()
    return subprocess.CompletedProcess([sys.executable, *command], p.exitcode, out, err), late


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def forked_python(*args: str, timeout: float = 300, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repository root, single-process, without a fresh interpreter importing torch (~3
    CPU-s each): ``train.py`` as ``train.main`` on a rank forked by tests/dist_harness.py (for tests that are not
    about the launch), a script forked from its preloaded forkserver (``run_as_python``); ``env``: variables set
    for a script."""
    from tests.test_train_e2e import run_forked

    if args[0] == "train.py":
        assert not env, "train.py: run_forked's environment"
        return run_forked(*args[1:], timeout=timeout)
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")},
           **(env or {})}
    proc, late = run_as_python(list(args), ROOT, env, timeout)
    assert not late, f"python {' '.join(args)} still ran after {timeout} s:\n{proc.stderr[-3000:]}"
    return proc

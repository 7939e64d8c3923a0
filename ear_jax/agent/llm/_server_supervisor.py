"""Runs one server command and ties its life to the process that started this one.

Run as a script (standard library only; never imports `ear_jax`) by `server.LlamaServer`:

  python -I _server_supervisor.py LIFELINE_FD STOP_TIMEOUT_S -- SERVER ARGV...

`LIFELINE_FD` is the read end of a pipe only the starter can write: its end-of-file (the starter
is gone), SIGTERM, SIGINT or SIGHUP stops the server (SIGTERM to its process group, SIGKILL after
`STOP_TIMEOUT_S`); a server exiting by itself ends the supervisor with its status. On Linux the
supervisor is a child subreaper and the server gets `PR_SET_PDEATHSIG` SIGKILL.
"""
import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.1
_STOP_POLL_S = 0.02


def _parent_death_kill(parent_pid: int):
  """A `preexec_fn` giving the child SIGKILL when this supervisor dies (None off Linux)."""
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
  except (OSError, AttributeError):
    return None

  def preexec():
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the supervisor died before prctl: no signal would come
      os._exit(1)  # pylint: disable=protected-access

  return preexec


def _become_subreaper() -> None:
  """Linux: orphaned descendants become this process's children (`_end_adopted` ends them)."""
  with contextlib.suppress(OSError, AttributeError):
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _exited(pid: int) -> bool:
  """True once the child `pid` has exited, without reaping it (so its group id is not reused)."""
  try:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
  except ChildProcessError:  # reaped already
    return True


def _signal_group(pgid: int, sig: int) -> None:
  with contextlib.suppress(ProcessLookupError, PermissionError):  # (the group is empty)
    os.killpg(pgid, sig)


def children_of(pid: int) -> list[int]:
  """The pids whose parent is `pid` (from /proc; [] where there is no /proc)."""
  out = []
  with contextlib.suppress(OSError):  # (no /proc)
    for name in filter(str.isdigit, os.listdir("/proc")):
      try:
        with open(f"/proc/{name}/stat", "rb") as f:
          fields = f.read().rsplit(b")", 1)[1].split()  # (the command may hold spaces and ')')
      except (OSError, IndexError):
        continue
      if len(fields) > 1 and fields[1] == str(pid).encode():
        out.append(int(name))
  return out


def _end_adopted() -> None:
  """SIGKILLs and reaps the orphaned descendants this supervisor adopted, until none is left."""
  for _ in range(100):
    kids = children_of(os.getpid())
    for pid in kids:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):  # (reaps every exited child)
      while os.waitpid(-1, os.WNOHANG)[0] != 0:
        pass
    if not kids:
      return
    time.sleep(_STOP_POLL_S)


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
  """SIGTERM to the server's group, SIGKILL after `timeout_s`, then to what is left and orphans."""
  if not _exited(proc.pid):
    _signal_group(proc.pid, signal.SIGTERM)  # the server leads its group: pgid = its pid
    deadline = time.monotonic() + timeout_s
    while not _exited(proc.pid) and time.monotonic() < deadline:
      time.sleep(_STOP_POLL_S)
    if not _exited(proc.pid):
      print(f"server supervisor: no exit {timeout_s:g}s after SIGTERM, killing the server",
            file=sys.stderr, flush=True)
  _signal_group(proc.pid, signal.SIGKILL)  # (its pid is not reused: not reaped yet)
  proc.wait()
  _end_adopted()


def main(argv) -> int:
  if len(argv) < 5 or argv[3] != "--":
    print("usage: _server_supervisor.py LIFELINE_FD STOP_TIMEOUT_S -- ARGV...", file=sys.stderr)
    return 2
  lifeline, stop_timeout_s, command = int(argv[1]), float(argv[2]), argv[4:]
  asked = []
  for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda signum, frame: asked.append(signum))
  _become_subreaper()
  try:
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_parent_death_kill(os.getpid()))
  except OSError as e:
    print(f"server supervisor: could not start {command[0]!r}: {e}", file=sys.stderr, flush=True)
    return 127
  while not _exited(proc.pid) and not asked:
    ready, _, _ = select.select([lifeline], [], [], _POLL_S)  # (retried after a signal: PEP 475)
    if ready and not os.read(lifeline, 1):  # end of file: the starting process is gone
      break
  _stop(proc, stop_timeout_s)
  code = proc.returncode
  if code < 0:  # killed by a signal: end the same way, so the starter sees the same status
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
  return code


if __name__ == "__main__":
  sys.exit(main(sys.argv))

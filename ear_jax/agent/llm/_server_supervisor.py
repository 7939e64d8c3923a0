"""Runs one server command and ties its life to the process that started this one.

Run as a script (never imported: it needs only the standard library, and importing `ear_jax`
would load JAX), by `ear_jax.agent.llm.server.LlamaServer`:

  python -I _server_supervisor.py LIFELINE_FD STOP_TIMEOUT_S -- SERVER ARGV...

`LIFELINE_FD` is the read end of a pipe whose only write end the starting process holds. The
kernel closes that end when the starting process exits, however it exits (SIGKILL included, and
whichever of its threads started the server), so end-of-file on the lifeline means "the starter is
gone": the server gets SIGTERM, SIGKILL after `STOP_TIMEOUT_S`, and this supervisor exits.
SIGTERM (or SIGINT / SIGHUP) to the supervisor stops the server the same way. When the server
exits by itself the supervisor exits with the server's status (the same code, or the same signal).

On Linux the server is also started with the parent-death signal SIGKILL
(`prctl(PR_SET_PDEATHSIG)`), bound to this single-threaded supervisor, so a SIGKILL of the
supervisor itself kills the server too. (The parent-death signal fires when the parent *thread*
exits: that is why it is set here, in a process with one thread, and not in the starting process,
whose starting thread may end long before the process.)
"""
import ctypes
import os
import select
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 0.1


def _parent_death_kill(parent_pid: int):
  """A `preexec_fn` (safe here: this process has one thread) giving the child SIGKILL when this
  supervisor dies, or None where `prctl` is missing (not Linux)."""
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
  except (OSError, AttributeError):
    return None

  def preexec():
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the supervisor died before prctl: no signal would come
      os._exit(1)  # pylint: disable=protected-access

  return preexec


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
  """SIGTERM, then SIGKILL after `timeout_s`; returns once the server has exited."""
  if proc.poll() is not None:
    return
  proc.send_signal(signal.SIGTERM)
  try:
    proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    print(f"server supervisor: no exit {timeout_s:g}s after SIGTERM, killing the server",
          file=sys.stderr, flush=True)
    proc.kill()
    proc.wait()


def main(argv) -> int:
  if len(argv) < 5 or argv[3] != "--":
    print("usage: _server_supervisor.py LIFELINE_FD STOP_TIMEOUT_S -- ARGV...", file=sys.stderr)
    return 2
  lifeline, stop_timeout_s, command = int(argv[1]), float(argv[2]), argv[4:]
  asked = []
  for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda signum, frame: asked.append(signum))
  try:
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                            preexec_fn=_parent_death_kill(os.getpid()))
  except OSError as e:
    print(f"server supervisor: could not start {command[0]!r}: {e}", file=sys.stderr, flush=True)
    return 127
  while proc.poll() is None:
    if asked:
      break
    try:
      ready, _, _ = select.select([lifeline], [], [], _POLL_S)
    except InterruptedError:  # a signal arrived (Python retries; kept for clarity)
      continue
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

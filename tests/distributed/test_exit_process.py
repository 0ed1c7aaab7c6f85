"""`distributed.exit_process`: two processes that call it both leave with their codes and with
their buffered output written; a process whose peer never arrives in jax's shutdown barrier
(which would wait jax's `shutdown_timeout_seconds`, 300 s) still exits with its code after
`within_s`."""
import subprocess
import sys

from tests.cpu_env import cpu_env
from tests.distributed.processes import free_port

_PROGRAM = """
import sys, time
import jax
from mars_jax import distributed
address, pid, code, within_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jax.distributed.initialize(address, 2, pid)
print(f"process {pid} done")  # buffered: the pipe is not a terminal
if code < 0:  # a host that never reaches its exit
    time.sleep(600)
distributed.exit_process(code, within_s=float(within_s) if within_s != "-" else None)
"""


def _start(address: str, pid: int, code: int, within_s: str = "-") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _PROGRAM, address, str(pid), str(code),
                             within_s], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cpu_env())


def test_both_processes_leave_with_their_codes_and_their_output_written():
    address = f"localhost:{free_port()}"
    runs = [_start(address, 0, 0), _start(address, 1, 3)]
    try:
        outputs = [run.communicate(timeout=120) for run in runs]
    finally:
        for run in runs:
            run.kill()
    for pid, (run, (stdout, stderr)) in enumerate(zip(runs, outputs)):
        assert run.returncode == (0, 3)[pid], stderr
        assert stdout == f"process {pid} done\n", stderr


def test_a_process_whose_peer_never_arrives_exits_with_its_code_after_within_s():
    address = f"localhost:{free_port()}"
    runs = [_start(address, 0, 75, within_s="1"), _start(address, 1, -1)]
    try:
        stdout, stderr = runs[0].communicate(timeout=120)  # not jax's 300 s
    finally:
        for run in runs:
            run.kill()
    assert runs[0].returncode == 75, stderr
    assert stdout == "process 0 done\n"
    assert "leaving jax.distributed took over 1 s" in stderr

"""Helpers for tests that start several processes of one job on localhost."""
import socket
import subprocess


def free_port() -> int:
    """A TCP port free on localhost now (for a coordinator)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def finish(runs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Waits for every process (killing all of them on the way out) and asserts each exited 0;
    returns their outputs."""
    try:
        outputs = [run.communicate(timeout=timeout)[0] for run in runs]
    finally:
        for run in runs:
            run.kill()
    for pid, (run, output) in enumerate(zip(runs, outputs)):
        assert run.returncode == 0, f"process {pid} failed:\n{output[-4000:]}"
    return outputs

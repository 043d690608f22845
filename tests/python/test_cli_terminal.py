"""The `weightstream` command as it behaves on a terminal, and durations on the command line.

The C++ CLI tests run the command with pipes; a terminal needs a pseudo-terminal, which
Python's `pty` gives without any extra tool.
"""
import os
import pty
import select
import subprocess

import pytest


def run_on_a_terminal(cli, *args, timeout=60):
    """Runs the command with stderr on a pseudo-terminal; returns (exit code, stderr text)."""
    controller, terminal = pty.openpty()
    try:
        process = subprocess.Popen([cli, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=terminal)
        os.close(terminal)
        terminal = -1
        captured = b""
        while True:
            ready, _, _ = select.select([controller], [], [], timeout)
            if not ready:
                process.kill()
                pytest.fail("the command wrote nothing for %d s" % timeout)
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the command closed its end
                break
            if not chunk:
                break
            captured += chunk
        return process.wait(timeout=timeout), captured.decode()
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)


@pytest.fixture(scope="module")
def checkpoint(cli, tmp_path_factory):
    path = tmp_path_factory.mktemp("terminal") / "llama"
    subprocess.run([cli, "synth", str(path), "--arch", "llama", "--size", "64MiB", "--hidden", "512"], check=True,
                   capture_output=True)
    return path


def test_the_first_progress_frame_never_shows_a_zero_eta(cli, checkpoint):
    # Small reads through a narrow pool make the load last several frames.
    code, err = run_on_a_terminal(cli, "load", str(checkpoint), "--concurrency", "1", "--chunk-size", "64KiB",
                                  "--memory-limit", "256KiB")
    assert code == 0, err
    frames = [frame for frame in err.replace("\n", "\r").split("\r") if frame.strip()]
    assert frames, err
    assert "ETA 0.0 s" not in frames[0], frames[0]
    assert "ETA --" in frames[0] or "done in" in frames[0], frames[0]
    assert "done in" in frames[-1], frames[-1]


def test_presign_takes_a_duration(cli):
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/"),
           "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
           "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}
    base = [cli, "s3", "presign", "s3://examplebucket/test.txt", "--date", "20130524T000000Z"]
    for duration, seconds in (("1h", 3600), ("15m", 900), ("90s", 90), ("86400", 86400)):
        result = subprocess.run(base + ["--expires", duration], env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert "X-Amz-Expires=%d&" % seconds in result.stdout
    for duration, needle in (("1.5s", "expected whole seconds from 1 s to 7 days"),
                             ("8d", "expected a positive duration"),
                             ("604801", "expected whole seconds from 1 s to 7 days")):
        result = subprocess.run(base + ["--expires", duration], env=env, capture_output=True, text=True)
        assert result.returncode == 2, result.stderr  # a malformed flag value: a usage error
        assert result.stderr.startswith("weightstream: error: --expires='%s': " % duration), result.stderr
        assert needle in result.stderr and result.stderr.endswith(" (see weightstream --help)\n")

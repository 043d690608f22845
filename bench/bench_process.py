"""What the GPU benches share: a flushed log line, and a checked subprocess run whose
failure names the command, its exit code and the end of its stderr."""
import subprocess


def log(*parts):
    print(*parts, flush=True)


def run(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed ({result.returncode}): {result.stderr.strip()[-600:]}")
    return result

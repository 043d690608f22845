"""A stand-in for SGLang's ``sgl_kernel`` (the ``sglang-kernel`` package), which is
CUDA-only and fails to import without ``libcuda.so.1``. On a CPU without AMX every SGLang
CPU op falls back to native torch, so the SGLang stage (scripts/sglang-test.sh) only needs
the module to import: any name it is asked for is a function that raises
NotImplementedError, so a kernel SGLang did call would fail the test loudly, never pass
it silently."""

from typing import Any, Callable

__version__ = "0.0.0+weightstream-test-stub"


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name} is a test stub (tests/python/sglang_stubs): SGLang called a "
                                  f"kernel the CPU test cannot run")

    kernel.__name__ = name
    return kernel

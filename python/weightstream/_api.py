"""The Python API of weightstream: open, stream, load and digest checkpoints."""

from __future__ import annotations

import json
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from . import _core
from ._tensors import check_framework, core_torch_tensors, present

Error = _core.Error
TensorInfo = _core.TensorInfo

_OPTIONS_DOC = """
    Options (keyword arguments; unset ones take the WEIGHTSTREAM_* environment variables,
    then the defaults, exactly as the command's flags do):

    concurrency  reads in flight at once (1 to 1024; default 16)
    memory_limit staging memory cap in bytes, an int or a string such as "64MiB"
                 (default "1GiB"; at least 4KiB)
    chunk_size   largest single read, int or string (default "16MiB"; at least 4KiB)
    io           how local files are read: "auto" (default: load() onto the CPU takes tensors in
                 place, other reads pread), "pread" (load() copies), "direct" (O_DIRECT),
                 "uring" or "mmap"
    gpu_path     how bytes reach a GPU: "auto" (default), "staged", "mapped" or "both"
                 (staged and mapped at once, on disjoint tensors)
    mapped_share with gpu_path="both": the fraction of the bytes mapped (default 0.4)
    prefetchers  threads mapping the pages of reads ahead of the readers when reads copy out
                 of a mapping (default None: 3 where the cores allow, else 0)
"""


def resolve_options(**options: Any) -> Dict[str, Any]:
    """The options a call with these keyword arguments would use, after the environment
    and the defaults: a dict of concurrency, memory_limit and chunk_size (in bytes), io,
    gpu_path, mapped_share and prefetchers (None: chosen by the cores). Raises weightstream.Error for a malformed value (for example
    memory_limit="12XB") and TypeError for an unknown option name.
    """
    return _core.resolve_options(options)


class Checkpoint:
    """An open safetensors checkpoint: a single file, or a directory (or S3 prefix) of
    shards with or without model.safetensors.index.json. Every header is read and checked
    when it opens; no tensor bytes are read until stream(), load() or digest().

    Tensors are listed in file order (shard by shard, offset by offset), the order in which
    stream() yields them.
    """

    def __init__(self, uri: str, **options: Any) -> None:
        self._core = _core.Checkpoint(str(uri), options)
        self._infos: Optional[List[TensorInfo]] = None

    @classmethod
    def _of(cls, core: Any) -> "Checkpoint":
        """Wraps a checkpoint the compiled core opened already (source resolution does, for
        the vLLM loader), so that its headers are read once."""
        checkpoint = cls.__new__(cls)
        checkpoint._core = core
        checkpoint._infos = None
        return checkpoint

    @property
    def _tensors(self) -> List[TensorInfo]:
        # Made on first use: a load that streams by name never needs thousands of them.
        if self._infos is None:
            self._infos = [self._core.info(i) for i in range(len(self._core))]
        return self._infos

    @property
    def _dtype_names(self) -> "set[str]":
        """The safetensors dtypes the checkpoint's tensors have."""
        return {info.dtype for info in self._tensors}

    @property
    def uri(self) -> str:
        """The URI the checkpoint was opened from."""
        return self._core.uri

    @property
    def options(self) -> Dict[str, Any]:
        """The options this checkpoint streams with unless a call overrides them."""
        return self._core.options

    @property
    def tensors(self) -> List[TensorInfo]:
        """Every tensor (name, dtype, shape, bytes, shard, offset), in file order."""
        return list(self._tensors)

    @property
    def names(self) -> List[str]:
        """Tensor names in file order."""
        return [info.name for info in self._tensors]

    @property
    def dtypes(self) -> Dict[str, str]:
        """Tensor name to safetensors dtype name ("BF16", "F32", ...)."""
        return {info.name: info.dtype for info in self._tensors}

    @property
    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Tensor name to shape."""
        return {info.name: info.shape for info in self._tensors}

    @property
    def shards(self) -> List[Tuple[str, int]]:
        """(file name, size in bytes) of every shard, in order."""
        return self._core.shards

    @property
    def nbytes(self) -> int:
        """Sum of every tensor's bytes."""
        return self._core.tensor_bytes

    @property
    def config(self) -> Optional[Dict[str, Any]]:
        """config.json beside the shards, parsed, or None when there is none."""
        text = self._core.config_json
        return None if text is None else json.loads(text)

    def __len__(self) -> int:
        return len(self._core)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._core.find(name) is not None

    def __getitem__(self, name: str) -> TensorInfo:
        index = self._core.find(name)
        if index is None:
            raise KeyError(f"no tensor '{name}' in {self.uri}")
        return self._tensors[index]

    def __repr__(self) -> str:
        return f"weightstream.Checkpoint({self.uri!r}, {len(self)} tensors, {self.nbytes} bytes, {len(self.shards)} shard(s))"

    def stream(self, device: str = "cpu", framework: Optional[str] = None, names: Optional[Iterable[str]] = None,
               **options: Any) -> "TensorIterator":
        """Streams every tensor in file order, or only those ``names`` lists (still in file
        order; reading no byte of the others); see weightstream.stream(). Raises KeyError
        for a name the checkpoint lacks."""
        check_framework(framework)
        selection: List[int] = []
        if names is not None:
            for name in names:
                index = self._core.find(name)
                if index is None:
                    raise KeyError(f"no tensor '{name}' in {self.uri}")
                selection.append(index)
            if not selection:
                return TensorIterator(self, _EmptyStream(), framework, 0)
        count = len(set(selection)) if names is not None else len(self)
        dtypes = {self._core.info(i).dtype for i in selection} if names is not None else self._dtype_names
        torch = core_torch_tensors(framework, dtypes)
        return TensorIterator(self, _core.TensorStream(self._core, device, options, selection, torch), framework, count)

    def load(self, device: str = "cpu", framework: Optional[str] = None, **options: Any) -> Dict[str, Any]:
        """Loads every tensor into one arena on ``device`` (on the CPU, at the default io,
        views of the page cache); see weightstream.load()."""
        check_framework(framework)
        loaded, _ = self._core.load(device, options, core_torch_tensors(framework, self._dtype_names))
        return {name: present(array, info.dtype, info.shape, framework)
                for (name, array), info in zip(loaded, self._tensors)}

    def digest(self, hash: str = "sha256", device: str = "cpu", **options: Any) -> Dict[str, str]:
        """Hashes every tensor's bytes; see weightstream.digest()."""
        return dict(self._core.digest(hash, device, options))


class _EmptyStream:
    """The stream of an empty selection: nothing to read, no reader thread."""

    queued_bytes = 0
    peak_queued_bytes = 0

    def __next__(self) -> Tuple[int, Any]:
        raise StopIteration

    def close(self) -> None:
        pass


class TensorIterator:
    """Iterator of ``(name, tensor)`` over a streaming checkpoint, in file order.

    A reader thread streams ahead into per-tensor buffers while at most memory_limit
    bytes of finished tensors wait to be taken (plus one tensor larger than the limit,
    alone). Waiting for the next tensor releases the GIL. An error of the stream raises
    weightstream.Error from next(). Leaving the loop early, close(), the end of a ``with``
    block or garbage collection stops the readers and frees what was not taken.
    """

    def __init__(self, checkpoint: Checkpoint, stream: Any, framework: Optional[str], count: int) -> None:
        self._checkpoint = checkpoint
        self._stream = stream
        self._framework = framework
        self._count = count
        self._closed = False

    def __iter__(self) -> "TensorIterator":
        return self

    def __next__(self) -> Tuple[str, Any]:
        if self._closed:
            raise StopIteration
        try:
            index, array = next(self._stream)
        except StopIteration:
            self.close()
            raise
        info = self._checkpoint._tensors[index]
        return info.name, present(array, info.dtype, info.shape, self._framework)

    def close(self) -> None:
        """Stops the stream and waits for its reader thread; tensors already taken stay valid."""
        if not self._closed:
            self._closed = True
            self._stream.close()

    def __enter__(self) -> "TensorIterator":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # The compiled stream also stops itself when freed; this makes it prompt.
        if not getattr(self, "_closed", True):
            self.close()

    def __len__(self) -> int:
        """Tensors this iterator yields in all."""
        return self._count

    @property
    def checkpoint(self) -> Checkpoint:
        """The checkpoint being streamed."""
        return self._checkpoint

    @property
    def queued_bytes(self) -> int:
        """Bytes of tensors read or being read and not yet taken."""
        return self._stream.queued_bytes

    @property
    def peak_queued_bytes(self) -> int:
        """Most bytes ever queued at once; at most max(memory_limit, largest tensor)."""
        return self._stream.peak_queued_bytes


def open(uri: str, **options: Any) -> Checkpoint:  # noqa: A001 - mirrors gzip.open and friends
    """Opens a checkpoint and reads every header: ``uri`` is a .safetensors file, a
    directory of shards, file://PATH, s3://bucket/prefix (S3 settings from the AWS_* and
    WEIGHTSTREAM_S3_* environment variables), gs://bucket/prefix (GCS credentials from
    STORAGE_EMULATOR_HOST, GOOGLE_APPLICATION_CREDENTIALS or the metadata server) or
    az://account/container/prefix (AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY,
    AZURE_STORAGE_SAS_TOKEN or the managed identity). Raises weightstream.Error naming the object
    and the rule broken (.code "not_found", "format", ...).
    """
    return Checkpoint(uri, **options)


def stream(uri: str, device: str = "cpu", framework: Optional[str] = None, **options: Any) -> TensorIterator:
    """Yields ``(name, tensor)`` for every tensor of the checkpoint at ``uri``, in file
    order, in bounded memory. ``device`` is "cpu" or "cuda:N" (a CUDA build is needed for
    the latter).

    Each tensor owns its memory and supports DLPack (``__dlpack__``, ``__dlpack_device__``),
    so ``torch.from_dlpack``, ``numpy.from_dlpack`` and ``cupy.from_dlpack`` take it without
    a copy. What a tensor is depends on ``framework``:

    - None (default): a ``nanobind.nb_ndarray`` (DLPack, and the buffer protocol on the
      host) with the checkpoint's dtype and shape. Dtypes numpy lacks (BF16, F8_E4M3,
      F8_E5M2 and the other F8 kinds) come as a torch.Tensor of torch's own dtype
      (bfloat16, float8_e4m3fn, float8_e5m2, ...) when torch is importable, and otherwise
      as raw bytes: uint8 of shape ``[*shape, itemsize]`` (view them with e.g. ml_dtypes).
      F4 and F6 tensors always come as flat uint8 bytes.
    - "torch": always a torch.Tensor of the checkpoint's dtype.
    - "numpy": always a numpy.ndarray (host only; raw dtypes as uint8 [*shape, itemsize]).
    """
    return Checkpoint(uri, **options).stream(device=device, framework=framework)


def load(uri: str, device: str = "cpu", framework: Optional[str] = None, **options: Any) -> Dict[str, Any]:
    """Loads every tensor of the checkpoint at ``uri`` into one arena on ``device`` and
    returns a dict of name to tensor, in file order. The arena is freed when the last
    tensor (or anything viewing it) is gone. Tensors are as stream() describes. With
    ``device="cpu"``, at the default ``io="auto"`` (and ``"mmap"``), the aligned tensors of
    local shards are copy-on-write views of the page cache instead (no copy; docs/PYTHON.md
    says what rewriting a shard in place does to them); ``io="pread"`` copies them.
    """
    return Checkpoint(uri, **options).load(device=device, framework=framework)


def digest(uri: str, hash: str = "sha256", device: str = "cpu", **options: Any) -> Dict[str, str]:
    """Hashes every tensor's bytes as they stream, in bounded memory: a dict of name to
    lowercase hex digest, in file order. ``hash`` is "sha256" or "xxh64"; with a CUDA
    ``device`` the bytes are hashed from what landed on the device. The values equal those
    of ``weightstream digest``.
    """
    return Checkpoint(uri, **options).digest(hash=hash, device=device)


for _function in (open, stream, load, digest):
    _function.__doc__ = (_function.__doc__ or "") + _OPTIONS_DOC
del _function

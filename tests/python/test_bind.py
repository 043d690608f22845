"""Engines own the memory (issue 17): numpy arrays bound to a layout's parameters receive
every load in place. A cold load, a reload from a second checkpoint and an update pushed over
shared memory all write into the bound arrays, whose bytes then equal `weightstream export`
of the same checkpoint and rank, at unchanged addresses. Every bad tensor is refused before
anything is bound, with its own message. The README's session snippet runs as written.
"""
import ctypes
import gc
import re
import subprocess
import threading
import weakref

import pytest
from conftest import CLI, ROOT, requires_cli

np = pytest.importorskip("numpy")
weightstream = pytest.importorskip("weightstream")

pytestmark = requires_cli

NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def synth(directory, seed, dtype="f32"):
    subprocess.run([CLI, "synth", str(directory), "--arch", "llama", "--layers", "2", "--seed", str(seed), "--dtype",
                    dtype], check=True, capture_output=True)
    return weightstream.open(str(directory))


def exported(checkpoint, tmp_path, tp_size=1, tp_rank=0):
    """Bytes of every parameter as `weightstream export` writes this rank."""
    out = tmp_path / f"export-{abs(hash(checkpoint.uri))}-{tp_size}-{tp_rank}.safetensors"
    subprocess.run([CLI, "export", checkpoint.uri, str(out), "--tp-size", str(tp_size), "--tp-rank", str(tp_rank)],
                   check=True, capture_output=True)
    return {name: np.ascontiguousarray(array).tobytes()
            for name, array in weightstream.load(str(out), framework="numpy").items()}


def engine_array(layout, name, fill=0x5A):
    """What an engine would have allocated for a parameter: numpy's dtype where it has one,
    otherwise the raw bytes uint8 [*shape, itemsize] (BF16). Filled with junk, so a byte
    that no load writes shows."""
    info = layout.parameter_info(name)
    if info["dtype"] in NUMPY_DTYPES:
        array = np.empty(info["shape"], dtype=NUMPY_DTYPES[info["dtype"]])
    else:
        itemsize = info["bytes"] // max(1, int(np.prod(info["shape"])))
        array = np.empty([*info["shape"], itemsize], dtype=np.uint8)
    array.view(np.uint8).fill(fill)
    return array


def bound_bytes(arrays):
    return {name: array.tobytes() for name, array in arrays.items()}


def push(layout, checkpoint, transport="shm"):
    """Pushes every tensor of `checkpoint` to `layout` through an UpdateReceiver."""
    receiver = weightstream.UpdateReceiver(layout, transport=transport, token="t0ken", timeout=30.0)
    reports = []
    thread = threading.Thread(target=lambda: reports.append(receiver.receive(accept_timeout=60.0)))
    thread.start()
    sender = weightstream.UpdateSender(receiver.address, transport=transport, token="t0ken", bucket_bytes=1 << 20)
    sender.start("checkpoint", [(name, checkpoint.dtypes[name], checkpoint.shapes[name]) for name in checkpoint.names])
    for name, tensor in checkpoint.stream(framework="numpy"):
        sender.send(name, tensor, checkpoint.dtypes[name])
    sender.finish()
    thread.join(timeout=60)
    assert not thread.is_alive() and reports
    return reports[0]


class Module:
    """Any object with named_parameters() and named_buffers(), as bind_module takes."""

    def __init__(self, parameters, buffers=()):
        self._parameters = list(parameters)
        self._buffers = list(buffers)

    def named_parameters(self):
        return iter(self._parameters)

    def named_buffers(self):
        return iter(self._buffers)


def test_bound_arrays_receive_a_cold_load_a_reload_and_a_pushed_update_in_place(tmp_path):
    first = synth(tmp_path / "first", 1)
    second = synth(tmp_path / "second", 2)
    layout = weightstream.model_layout(first, tp_size=2, tp_rank=1, device="cpu")
    arrays = {name: engine_array(layout, name) for name in layout.parameter_names}
    for name, array in arrays.items():
        layout.bind(name, array)
    assert layout.bound_names == layout.parameter_names and layout.unbound_names == []
    addresses = {name: array.ctypes.data for name, array in arrays.items()}
    hook_runs = []
    layout.add_hook("count", lambda: hook_runs.append(layout.loads_finished))

    session = weightstream.LoadSession(layout)
    session.begin("cold")
    session.load_checkpoint(first)
    session.finish()
    expected_first = exported(first, tmp_path, 2, 1)
    assert set(expected_first) == set(arrays)
    assert bound_bytes(arrays) == expected_first
    assert layout.allocated_bytes == 0, "every parameter is the engine's: the layout allocates nothing"
    # layout.tensor() views the engine's memory itself.
    for name, array in arrays.items():
        assert np.from_dlpack(layout.tensor(name)).ctypes.data == array.ctypes.data

    session.begin("reload")
    session.load_checkpoint(second)
    session.finish()
    assert bound_bytes(arrays) == exported(second, tmp_path, 2, 1)
    assert {name: array.ctypes.data for name, array in arrays.items()} == addresses

    report = push(layout, first, "shm")
    assert report["model_hook_runs"] == 1
    assert bound_bytes(arrays) == expected_first
    assert {name: array.ctypes.data for name, array in arrays.items()} == addresses
    assert hook_runs == [0, 1, 2], "the model hook runs once per load, reload and update"
    assert layout.allocated_bytes == 0


def test_bind_module_binds_the_names_it_shares_and_the_rest_is_allocated_at_the_first_load(tmp_path):
    checkpoint = synth(tmp_path / "bf16", 3, "bf16")
    layout = weightstream.model_layout(checkpoint, device="cpu")
    names = layout.parameter_names
    # The engine holds layer 0 (BF16 as raw uint8 [*shape, 2], numpy having no bfloat16),
    # its module prefixes nothing of "model.", and it has a buffer the layout does not know.
    ours = [name for name in names if name.startswith("model.layers.0.")]
    arrays = {name: engine_array(layout, name) for name in ours}
    module = Module([(name[len("model."):], arrays[name]) for name in ours],
                    [("layers.0.self_attn.rotary_emb.inv_freq", np.zeros(8, dtype=np.float32))])
    assert layout.bind_module(module, prefix="model") == ours
    assert layout.bound_names == ours
    assert layout.unbound_names == [name for name in names if name not in ours]
    assert layout.allocated_bytes == 0, "nothing is allocated before the first load"

    session = weightstream.LoadSession(layout)
    session.begin("cold")
    session.load_checkpoint(checkpoint)
    session.finish()
    expected = exported(checkpoint, tmp_path)
    assert bound_bytes(arrays) == {name: expected[name] for name in ours}
    assert layout.allocated_bytes > 0
    for name in names:
        view = np.from_dlpack(layout.tensor(name))
        assert view.tobytes() == expected[name]
        if name in arrays:
            assert view.ctypes.data == arrays[name].ctypes.data


def test_the_readme_session_snippet_runs_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    snippet = [block for block in blocks if "layout.bind_module(model)" in block]
    assert len(snippet) == 1, "README.md has one session snippet binding a module"
    ckpt = synth(tmp_path / "ckpt", 4)
    new_ckpt = synth(tmp_path / "new_ckpt", 5)
    shapes = weightstream.model_layout(ckpt, tp_size=2, tp_rank=0)
    # The engine's model: every decoder layer's parameters (the embedding, norm and head are
    # left to the layout).
    arrays = {name: engine_array(shapes, name) for name in shapes.parameter_names if name.startswith("model.layers.")}
    namespace = {"weightstream": weightstream, "ckpt": ckpt, "new_ckpt": new_ckpt, "model": Module(arrays.items())}
    exec(compile(snippet[0], "README.md", "exec"), namespace)
    layout = namespace["layout"]
    assert layout.bound_names == list(arrays)
    expected = exported(new_ckpt, tmp_path, 2, 0)
    assert bound_bytes(arrays) == {name: expected[name] for name in arrays}
    assert {name: np.from_dlpack(layout.tensor(name)).tobytes() for name in layout.parameter_names} == expected


# ---- bad input: each refused with its own message, before anything is bound --------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("bad_input"), 6)


NAME = "model.layers.0.mlp.down_proj.weight"


def layout_and_shape(checkpoint, **options):
    layout = weightstream.model_layout(checkpoint, device="cpu", **options)
    return layout, tuple(layout.parameter_info(NAME)["shape"])


def test_bind_refuses_a_wrong_shape(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    wrong = np.zeros((shape[1], shape[0]), dtype=np.float32)
    with pytest.raises(weightstream.Error) as error:
        layout.bind(NAME, wrong)
    assert error.value.code == "model"
    assert (f"cannot bind parameter {NAME} of llama tp 1 rank 0: expected shape [{shape[0]}, {shape[1]}], "
            f"given [{shape[1]}, {shape[0]}]") in str(error.value)
    assert layout.bound_names == []


def test_bind_refuses_a_wrong_dtype(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    with pytest.raises(weightstream.Error, match=f"cannot bind parameter {NAME} .*expected dtype F32, given F64"):
        layout.bind(NAME, np.zeros(shape, dtype=np.float64))
    with pytest.raises(weightstream.Error, match="expected dtype F32, given a DLPack dtype safetensors has no name for"):
        layout.bind(NAME, np.zeros(shape, dtype=np.complex128))


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class CudaLookalike:
    """A DLPack producer that says its float32 memory is on cuda:0 (no GPU needed: the
    device is checked before a byte is touched; the address is a host array's)."""

    def __init__(self, shape):
        self._host = np.zeros(shape, dtype=np.float32)
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._managed = _DLManagedTensor()
        tensor = self._managed.dl_tensor
        tensor.data = self._host.ctypes.data
        tensor.device = _DLDevice(2, 0)  # kDLCUDA
        tensor.ndim = len(shape)
        tensor.dtype = _DLDataType(2, 32, 1)  # float32
        tensor.shape = self._shape

    def __dlpack__(self, **kwargs):
        return _capsule_new(ctypes.addressof(self._managed), b"dltensor", None)

    def __dlpack_device__(self):
        return (2, 0)


def test_bind_refuses_memory_on_another_device(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    with pytest.raises(weightstream.Error) as error:
        layout.bind(NAME, CudaLookalike(shape))
    assert error.value.code == "model"
    assert (f"cannot bind parameter {NAME} of llama tp 1 rank 0: expected memory on cpu (where the layout's storage "
            "lives), given memory on cuda:0") in str(error.value)
    # Without a device given, the first bind fixes it: later ones must match.
    layout = weightstream.model_layout(checkpoint)
    layout.bind(NAME, np.zeros(shape, dtype=np.float32))
    other = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(weightstream.Error, match=f"{other} .*expected memory on cpu .*given memory on cuda:0"):
        layout.bind(other, CudaLookalike(shape))
    assert layout.bound_names == [NAME]


def test_bind_refuses_a_non_contiguous_tensor(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    transposed = np.zeros((shape[1], shape[0]), dtype=np.float32).T
    with pytest.raises(weightstream.Error) as error:
        layout.bind(NAME, transposed)
    assert (f"cannot bind parameter {NAME} of llama tp 1 rank 0: expected a contiguous (row-major) tensor, given shape "
            f"[{shape[0]}, {shape[1]}] with strides [1, {shape[0]}]") in str(error.value)
    sliced = np.zeros((shape[0], 2 * shape[1]), dtype=np.float32)[:, ::2]
    with pytest.raises(weightstream.Error, match="expected a contiguous"):
        layout.bind(NAME, sliced)


def test_bind_refuses_a_misaligned_address(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    count = shape[0] * shape[1]
    storage = np.zeros(4 * count + 4, dtype=np.uint8)
    misaligned = np.frombuffer(storage, dtype=np.float32, count=count, offset=1 if storage.ctypes.data % 4 == 0 else 0)
    misaligned = misaligned.reshape(shape)
    assert misaligned.ctypes.data % 4 != 0
    with pytest.raises(weightstream.Error) as error:
        layout.bind(NAME, misaligned)
    assert (f"cannot bind parameter {NAME} of llama tp 1 rank 0: expected an address aligned to 4 bytes (F32 elements), "
            "given 0x") in str(error.value)


def test_bind_refuses_a_read_only_tensor_and_what_is_not_a_tensor(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    frozen = np.zeros(shape, dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(weightstream.Error, match=f"cannot bind parameter {NAME} .*expected a writable tensor"):
        layout.bind(NAME, frozen)
    with pytest.raises(weightstream.Error, match=r"expected a DLPack tensor \(torch, numpy, cupy\), given list"):
        layout.bind(NAME, [0.0] * shape[0])


def test_bind_refuses_an_unknown_name_a_second_bind_and_a_bind_after_the_first_load(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    with pytest.raises(weightstream.Error, match="cannot bind parameter model.nope: it is not in llama") as error:
        layout.bind("model.nope", np.zeros(shape, dtype=np.float32))
    assert error.value.code == "not_found"
    layout.bind(NAME, np.zeros(shape, dtype=np.float32))
    with pytest.raises(weightstream.Error, match=f"cannot bind parameter {NAME} .*it is already bound"):
        layout.bind(NAME, np.zeros(shape, dtype=np.float32))
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    session.load_checkpoint(checkpoint)
    session.finish()
    other = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(weightstream.Error, match=f"cannot bind parameter {other} .*has been loaded.*never moves"):
        layout.bind(other, np.zeros(shape, dtype=np.float32))


def test_bind_refuses_memory_that_another_parameter_is_bound_to(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    shared = np.zeros(shape, dtype=np.float32)
    layout.bind(NAME, shared)
    other = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(weightstream.Error, match=f"cannot bind parameter {other} .*overlaps parameter {NAME}'s"):
        layout.bind(other, shared)
    assert layout.bound_names == [NAME]


def test_bind_module_whose_names_match_nothing_lists_both_sides(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    module = Module([(f"encoder.block.{i}.weight", np.zeros(4, dtype=np.float32)) for i in range(7)])
    with pytest.raises(weightstream.Error) as error:
        layout.bind_module(module)
    message = str(error.value)
    assert ("bind_module: none of the 7 parameters and buffers of test_bind.Module (with prefix '') is one of the "
            f"{len(layout.parameter_names)} parameters of llama tp 1 rank 0: ") in message
    assert "the module has encoder.block.0.weight, encoder.block.1.weight, encoder.block.2.weight, " \
           "encoder.block.3.weight, encoder.block.4.weight (and 2 more)" in message
    assert "the layout has model.embed_tokens.weight, " in message
    with pytest.raises(weightstream.Error, match="expected a module with named_parameters"):
        layout.bind_module(object())


def test_bind_module_binds_nothing_when_one_tensor_is_refused(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    good = ("model.layers.0.input_layernorm.weight", engine_array(layout, "model.layers.0.input_layernorm.weight"))
    bad = (NAME, np.zeros((shape[1], shape[0]), dtype=np.float32))
    with pytest.raises(weightstream.Error, match=f"{NAME} .*expected shape"):
        layout.bind_module(Module([good, bad]))
    assert layout.bound_names == []


def test_bind_many_binds_every_pair_in_one_call_and_nothing_when_one_is_refused(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    assert [name for name, _, _ in layout.parameters] == layout.parameter_names
    assert dict((name, (dtype, shape)) for name, dtype, shape in layout.parameters)[NAME] == ("F32", tuple(shape))
    arrays = {name: engine_array(layout, name) for name in layout.parameter_names}
    bad = np.zeros((shape[1], shape[0]), dtype=np.float32)
    with pytest.raises(weightstream.Error, match=f"cannot bind parameter {NAME} .*expected shape"):
        layout.bind_many([(name, bad if name == NAME else array) for name, array in arrays.items()])
    assert layout.bound_names == [], "one refused pair binds nothing"
    with pytest.raises(TypeError, match=r"\(name, tensor\) pairs"):
        layout.bind_many([(NAME,)])
    layout.bind_many(list(arrays.items()))
    assert layout.bound_names == layout.parameter_names
    for name, array in arrays.items():
        assert np.from_dlpack(layout.tensor(name)).ctypes.data == array.ctypes.data


def test_the_layout_keeps_bound_tensors_alive(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    array = np.zeros(shape, dtype=np.float32)
    alive = weakref.ref(array)
    layout.bind(NAME, array)
    del array
    gc.collect()
    assert alive() is not None, "the layout holds what it writes into"
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    session.load_checkpoint(checkpoint)
    session.finish()
    assert alive().tobytes() == np.from_dlpack(layout.tensor(NAME)).tobytes()
    assert alive().any()
    del session, layout
    gc.collect()
    assert alive() is None, "and lets go of it with the layout"


class RequiresGrad:
    """Behaves as a torch Parameter that requires grad: it refuses to export itself through
    DLPack, and its detach() is the same memory."""

    def __init__(self, array):
        self._array = array
        self.requires_grad = True

    def __dlpack__(self, **kwargs):
        raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")

    def __dlpack_device__(self):
        return (1, 0)

    def detach(self):
        return self._array


def test_a_tensor_that_requires_grad_is_bound_through_detach(checkpoint):
    layout, shape = layout_and_shape(checkpoint)
    array = np.zeros(shape, dtype=np.float32)
    parameter = RequiresGrad(array)
    alive = weakref.ref(parameter)
    layout.bind_module(Module([(NAME, parameter)]))
    del parameter
    gc.collect()
    assert alive() is not None, "the layout holds the object it was given"
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    session.load_checkpoint(checkpoint)
    session.finish()
    assert array.any() and array.tobytes() == np.from_dlpack(layout.tensor(NAME)).tobytes()
    assert np.from_dlpack(layout.tensor(NAME)).ctypes.data == array.ctypes.data


def test_identity_layout_binds_arrays_named_as_the_checkpoint_and_loads_them_in_place(tmp_path):
    import subprocess
    from conftest import CLI
    subprocess.run([CLI, "synth", str(tmp_path / "ckpt"), "--arch", "llama", "--layers", "1", "--seed", "4"], check=True,
                   capture_output=True)
    checkpoint = weightstream.open(str(tmp_path / "ckpt"))
    layout = weightstream.identity_layout(checkpoint, device="cpu")
    assert sorted(layout.parameter_names) == sorted(t.name for t in checkpoint.tensors)
    name = "model.norm.weight"
    info = next(t for t in checkpoint.tensors if t.name == name)
    array = np.zeros(list(info.shape) + [2], dtype=np.uint8)  # BF16 as raw bytes
    address = array.ctypes.data
    layout.bind(name, array)
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    session.load_checkpoint(checkpoint)
    session.finish()
    assert array.ctypes.data == address
    # The same bytes as a layout of its own holds after a load (BF16 as raw uint8 bytes).
    reference = weightstream.identity_layout(checkpoint, device="cpu")
    other = weightstream.LoadSession(reference)
    other.begin("cold")
    other.load_checkpoint(checkpoint)
    other.finish()
    assert array.tobytes() == np.array(np.from_dlpack(reference.tensor(name))).tobytes()

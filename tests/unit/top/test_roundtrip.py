"""Bit-exact round trips: dtypes, shapes, strides, TensorDicts, modules and optimizers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import ckptstore
from ckptstore.errors import ShapeMismatchError, UnsupportedDtypeError, UnsupportedTypeError
from ckptstore.core.shards import DTYPES

from tests.conftest import assert_bit_equal, row_count

PROPERTY_DTYPES = [torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int16,
                   torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads included) viewed as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(PROPERTY_DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple) | st.just((3000, 2)),
    transpose=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_round_trip(tmp_path_factory, dtype, shape, transpose, seed):
    s = ckptstore.Store(tmp_path_factory.mktemp("s"), shard_bytes=4096)
    t = random_tensor(dtype, shape, seed)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous input
    s.commit({"t": t, "view": t[::2] if t.dim() else t}, tag="x")
    back = s.checkout("x")
    assert_bit_equal(back["t"], t)
    assert_bit_equal(back["view"], t[::2] if t.dim() else t)
    s.close()


def patterns() -> dict[str, torch.Tensor]:
    """C14: one length-8 tensor per dtype, filled by viewing integer bit patterns."""
    out = {}
    # NaN with payload, -0.0, +inf, -inf, smallest subnormal, max, 1.0, all-ones NaN
    out["float32"] = torch.tensor(
        [0x7FC00001, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x7F7FFFFF, 0x3F800000, 0xFFFFFFFF], dtype=torch.uint32
    ).view(torch.float32)
    out["float64"] = torch.tensor(
        [0x7FF8000000000001, 0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000, 1, 0x7FEFFFFFFFFFFFFF, 0x3FF0000000000000, 2**64 - 1],
        dtype=torch.uint64,
    ).view(torch.float64)
    u16 = torch.tensor([0x7E01, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x7BFF, 0x3C00, 0xFFFF], dtype=torch.uint16)
    out["float16"] = u16.view(torch.float16)
    out["bfloat16"] = torch.tensor([0x7FC1, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x7F7F, 0x3F80, 0xFFFF], dtype=torch.uint16).view(torch.bfloat16)
    u8 = torch.tensor([0x7F, 0x80, 0x7C, 0xFC, 0x01, 0x7E, 0x38, 0xFF], dtype=torch.uint8)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
        if hasattr(torch, name):
            out[name] = u8.view(getattr(torch, name))
    out["complex64"] = torch.cat([out["float32"], out["float32"].flip(0)]).view(torch.complex64)
    out["complex128"] = torch.cat([out["float64"], out["float64"].flip(0)]).view(torch.complex128)
    out["bool"] = torch.tensor([True, False, True, True, False, False, True, False])
    for bits in (8, 16, 32, 64):
        out[f"int{bits}"] = torch.tensor([0, -1, 1, 2 ** (bits - 1) - 1, -(2 ** (bits - 1)), 5, -5, 7], dtype=getattr(torch, f"int{bits}"))
    for bits in (8, 16, 32):
        out[f"uint{bits}"] = torch.tensor([0, 2**bits - 1, 1, 2 ** (bits - 1), 3, 4, 5, 6], dtype=getattr(torch, f"uint{bits}"))
    out["uint64"] = torch.tensor([0, -1, 1, -(2**63), 3, 4, 5, 6], dtype=torch.int64).view(torch.uint64)  # 2^64-1, 2^63
    for name, t in list(out.items()):
        out[name + "_0d"] = t[3].clone()
    return out


def test_c14_dtype_matrix(store, tmp_path):
    data = patterns()
    first = store.commit(data, tag="dtypes")
    back = store.checkout("dtypes")
    for name, t in data.items():
        assert_bit_equal(back[name], t)
        if name.endswith("_0d"):
            assert back[name].shape == torch.Size([])
    # stable hashes: a second commit of the same data writes nothing new
    second = store.commit(data, tag="again")
    assert (second.shards_new, second.new_bytes, second.stored_bytes) == (0, 0, 0)
    assert second.shards_total == first.shards_total == len(data)
    # ZIP export and re-import give the same bits
    store.export("dtypes", tmp_path / "dtypes.zip")
    other = ckptstore.Store(tmp_path / "other", create=True)
    other.import_from(tmp_path / "dtypes.zip", tag="imported")
    again = other.checkout("imported")
    for name, t in data.items():
        assert_bit_equal(again[name], t)
    other.close()


def test_every_raw_dtype_of_this_torch_round_trips(store):
    data = {name: torch.arange(16, dtype=torch.uint8).view(dtype) for name, dtype in DTYPES.items() if 16 % dtype.itemsize == 0}
    store.commit(data, tag="all")
    back = store.checkout("all")
    for name, t in data.items():
        assert_bit_equal(back[name], t)


def test_quantized_dtype_is_rejected_not_converted(store):
    q = torch.quantize_per_tensor(torch.ones(4), 0.5, 0, torch.qint8)
    before = row_count(store)
    with pytest.raises(UnsupportedDtypeError, match="q"):
        store.commit({"q": q}, tag="q")
    assert row_count(store) == before


def test_c08_zero_element_tensors_keep_key_shape_dtype(store, tmp_path):
    td = TensorDict(
        {"empty": torch.zeros(0, 1, dtype=torch.int64), "e3": torch.zeros(0, 3), "sub": {"e": torch.zeros(2, 0, dtype=torch.bool)}, "x": torch.arange(4.0)},
        batch_size=[],
    )
    store.commit(td, tag="z")
    store.export("z", tmp_path / "dir")
    store.export("z", tmp_path / "z.zip")
    other = ckptstore.Store(tmp_path / "other", create=True)
    other.import_from(tmp_path / "dir", tag="d")
    other.import_from(tmp_path / "z.zip", tag="zip")
    for s, ref in ((store, "z"), (other, "d"), (other, "zip")):
        back = s.checkout(ref)
        assert isinstance(back, TensorDict)
        for key in ("empty", "e3", ("sub", "e"), "x"):
            assert_bit_equal(back[key], td[key])
    rows = store.catalog.rows("SELECT l.path, b.hash, b.raw_len FROM leaves l JOIN shards s ON s.leaf_id = l.id "
                              "JOIN blobs b ON b.id = s.blob_id WHERE l.nbytes = 0")
    assert len(rows) == 3 and len({bytes(r["hash"]) for r in rows}) == 1 and {r["raw_len"] for r in rows} == {0}
    other.close()


def test_c13_dense_layouts_keep_their_strides(store):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    assert conv.weight.stride() == (27, 1, 9, 3)
    x = torch.randn(4, 5).t()
    y = torch.randn(2, 3, 4).permute(2, 0, 1)
    z = torch.randn(6, 6)[::2, 1::2]
    store.commit({"conv": conv, "x": x, "y": y, "z": z}, tag="s")
    back = store.checkout("s")
    for k, v in {"x": x, "y": y, "z": z, ("conv", "weight"): conv.weight}.items():
        assert_bit_equal(back[k], v)
    # dense permuted layouts come back with their strides; views with gaps come back C-contiguous (documented)
    assert back["conv", "weight"].stride() == (27, 1, 9, 3)
    assert back["conv", "weight"].is_contiguous(memory_format=torch.channels_last)
    assert back["x"].stride() == x.stride() == (1, 5)
    assert back["y"].stride() == y.stride()
    assert back["z"].is_contiguous() and back["z"].stride() != z.stride()
    # into a module, the target's own layout is kept (load_state_dict copies values)
    conv2 = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    store.checkout("s", into={"conv": conv2}, partial=["conv"])
    inp = torch.randn(1, 3, 8, 8)
    assert torch.equal(conv(inp), conv2(inp))


class Scalars(torch.nn.Module):
    def __init__(self, shape=()):
        super().__init__()
        self.threshold = torch.nn.Parameter(torch.full(shape, 0.5))
        self.register_buffer("steps", torch.tensor(7, dtype=torch.int64))


def test_c15_zero_d_stays_zero_d_and_mismatches_are_refused(store):
    m = Scalars()
    store.commit(m, tag="ok")
    bad, one = Scalars((32000,)), Scalars((1,))
    store.commit(bad, tag="bad")
    store.commit(one, tag="one")
    back = store.checkout("ok")
    assert back["threshold"].shape == torch.Size([]) and back["steps"].shape == torch.Size([])
    target = Scalars()
    with torch.no_grad():
        target.threshold.fill_(9.0)
    for ref in ("bad", "one"):  # documented: no size-1 leniency
        with pytest.raises(ShapeMismatchError, match="threshold"):
            store.checkout(ref, into=target)
        assert target.threshold.item() == 9.0 and target.threshold.shape == torch.Size([])
    store.checkout("ok", into=target)
    assert target.threshold.item() == 0.5 and target.steps.item() == 7


def test_module_and_optimizer_bit_exact_and_next_step_identical(store):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = torch.randn(32, 8), torch.randn(32, 2)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    store.commit({"net": net, "opt": opt}, tag="t")
    net2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.5)
    store.checkout("t", into={"net": net2, "opt": opt2})
    assert opt2.param_groups[0]["lr"] == 1e-3 and opt2.param_groups[0]["betas"] == (0.9, 0.999)
    for a, b in zip(net.parameters(), net2.parameters()):
        assert_bit_equal(a, b)
    for o in (opt, opt2):
        o.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    torch.nn.functional.mse_loss(net2(x), y).backward()
    opt.step()
    opt2.step()
    for a, b in zip(net.parameters(), net2.parameters()):
        assert_bit_equal(a, b)


def test_nested_tensordict_with_non_tensor_leaves(store):
    td = TensorDict({"a": torch.arange(6).view(3, 2), "n": {"b": torch.ones(3, 1)}}, batch_size=[3])
    td.set_non_tensor("meta", {"x": (1, 2), "y": [1.5, None]})
    store.commit(td, tag="td")
    back = store.checkout("td")
    assert back.batch_size == torch.Size([3])
    assert_bit_equal(back["a"], td["a"])
    assert_bit_equal(back["n", "b"], td["n", "b"])
    assert back["meta"] == {"x": (1, 2), "y": [1.5, None]} and type(back["meta"]["x"]) is tuple
    target = TensorDict({"a": torch.zeros(3, 2, dtype=torch.int64), "n": {"b": torch.zeros(3, 1)}}, batch_size=[3])
    a_storage = target["a"].data_ptr()
    store.checkout("td", into=target)
    assert target["a"].data_ptr() == a_storage  # written in place
    assert_bit_equal(target["a"], td["a"])


def test_unpicklable_object_error_names_path_and_type(store):
    class Opaque:
        pass

    before = row_count(store)
    with pytest.raises(UnsupportedTypeError, match=r"extra/thing.*Opaque"):
        store.commit({"net": torch.nn.Linear(2, 2), "extra": {"thing": Opaque()}}, tag="x")
    with pytest.raises(UnsupportedTypeError, match=r"progress.*numpy"):
        import numpy as np

        store.commit({"progress": {"step": np.datetime64("2020-01-01")}}, tag="x")  # numpy scalars without an exact JSON form
    assert row_count(store) == before


@pytest.mark.parametrize(
    ("shape", "dtype", "shard_bytes", "count"),
    [
        ((10000, 1024), torch.float32, 256 << 10, 157),  # 4 KiB rows: 64 rows per shard
        ((1 << 20, 1), torch.float32, 4096 * 4, 256),  # a narrow column: 4096 rows per shard
        ((1 << 24,), torch.float32, 4096 * 4, 4096),  # exactly MAX_SHARDS shards: the cap holds
        ((1 + (1 << 24),), torch.float32, 8192 * 4, 2049),  # one row more: the cap doubles once
        ((1 << 28,), torch.float32, 256 << 10, 4096),  # 1 GiB 1-d: target-sized shards
        ((3, 1 << 20), torch.uint8, 256 << 10, 12),  # rows larger than the target are cut
    ],
)
def test_shard_plan(shape, dtype, shard_bytes, count):
    from ckptstore.core.shards import plan

    p = plan(shape, dtype)
    assert (p.shard_bytes, p.count) == (shard_bytes, count)


def test_numpy_arrays_round_trip_with_dtype_and_shape(store, tmp_path):
    import numpy as np

    arrays = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4), "be": np.array([1, -2, 3], dtype=">i4"),
        "bool": np.array([True, False]), "u16": np.array([0, 65535], dtype=np.uint16), "c64": np.array([1 + 2j], dtype=np.complex64),
        "empty": np.zeros((0, 5), dtype=np.float64), "t": np.arange(6, dtype=np.int64).reshape(2, 3).T,  # non-contiguous
    }
    store.commit({"arrays": arrays, "w": torch.ones(2)}, tag="np")
    target = {"arrays": {k: np.zeros_like(v) for k, v in arrays.items()}, "w": torch.zeros(2)}
    store.checkout("np", into=target)
    for k, v in arrays.items():
        got = target["arrays"][k]
        assert type(got) is np.ndarray and got.dtype == v.dtype and got.shape == v.shape and np.array_equal(got, v), k
    store.commit(arrays["be"], tag="bare")
    bare = store.checkout("bare")
    assert type(bare) is np.ndarray and bare.dtype == np.dtype(">i4") and bare.tolist() == [1, -2, 3]
    with pytest.raises(ckptstore.errors.UnsupportedTypeError, match="numpy dtype object"):
        store.commit({"o": np.array(["x"], dtype=object)})
    with pytest.raises(ckptstore.errors.ShapeMismatchError, match="stored ndarray"):
        store.checkout("np", into={"arrays": {**target["arrays"], "f32": np.zeros((4, 3), np.float32)}, "w": torch.zeros(2)})


def test_a_commit_from_another_device_checks_out_with_map_location(store):
    """A TensorDict committed on cuda:0 (its device is component metadata) on a machine without that device."""
    from tensordict import TensorDict

    td = TensorDict({"obs": torch.arange(6.0).view(2, 3), "nested": {"a": torch.ones(2)}}, [2])
    comps = ckptstore.adapters.capture(td, store.registry)
    comps[0].meta = {**comps[0].meta, "device": "cuda:7"}  # as made on a GPU machine with 8 devices
    store.commit_components(comps, tag="gpu")
    if torch.cuda.device_count() < 8:
        with pytest.raises(ckptstore.errors.TargetMismatchError, match="stored on cuda:7.*map_location='cpu'"):
            store.checkout("gpu")
    back = store.checkout("gpu", map_location="cpu")
    assert back.device == torch.device("cpu") and back.batch_size == torch.Size([2])
    assert torch.equal(back["obs"], td["obs"]) and torch.equal(back["nested", "a"], td["nested", "a"])
    assert store.components("gpu")[""]["meta"]["device"] == "cuda:7"  # the stored record is unchanged


def test_rng_state_can_skip_cuda_explicitly(store):
    state = ckptstore.RNGState(cuda=False)
    store.commit({"rng": state}, tag="r")
    assert not any(k.startswith("rng/cuda") for k in (r.path for r in store.manifest("r")))
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    store.commit({"rng": state}, tag="r2")
    torch.rand(10)
    store.checkout("r2", into={"rng": ckptstore.RNGState(cuda=False)})
    assert torch.equal(torch.rand(3), want)

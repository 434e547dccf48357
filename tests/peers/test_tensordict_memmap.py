"""Port of tensordict's own memmap save/load round-trip tests.

Upstream: pytorch/tensordict test/tensordict/test_generic.py, class ``TestTensorDictsBase``
tests ``test_memmap_``, ``test_memmap_prefix``, ``test_memmap_threads`` (the version
stored as file id 55916844293 in the reference index) and
``test_save_load_memmap_stacked_td`` (test/test_tensordict.py), and
test/test_tensorclass.py ``TestMemmap.test_load_scenarios`` (file id 2405490485); the tensordicts they run
on are test/_utils_internal.py's ``TestTensorDictsBase`` ones (commit
029de18bfa4f1d1b476d15ec0d8244db89bb1c1c), on CPU, plus ``td_with_non_tensor``.

Every test runs twice (fixture ``storage``): with tensordict's own memory-mapped folder
(``memmap_``/``memmap``/``load_memmap``, the peer's storage) and through a ckptstore
store (``Store.commit`` / ``commit_async``, then ``Store.checkout``). Differences:

- test_memmap_prefix: the asserts on ``meta.json`` (its path and its ``shape``) are
  dropped: they are the peer's own file. For ``sub_td``, ``sub_td2`` and
  ``td_params`` upstream asserts that ``memmap_`` refuses to convert them in place;
  a commit converts nothing, so the ckptstore run asserts the round trip instead.
- test_memmap_: the ``some_other_path`` folder made inside the peer's prefix (to
  check load_memmap skips unregistered sub-folders) is not made for ckptstore, whose
  location is a store, not a tensordict folder; ``use_dir=False`` (a temporary
  location nothing loads back) is not ported.
- test_load_scenarios: after ``data.apply_(lambda x: x + 1)`` upstream asserts the
  loaded copy changed too (both map the same files: the peer's mechanism), and that
  ``MyOtherClass.load_memmap`` returns a ``MyClass`` (the class named in the peer's
  ``meta.json``); ckptstore never imports a class named by stored data, so neither is
  asserted for ckptstore, which checks out into a ``MyClass`` target instead.
- test_memmap_existing, test_memmap_like and test_make_memmap are not ported: their
  subject is which memory-mapped file a tensor is bound to, not a save/load.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict, assert_allclose_td, tensorclass
from tensordict.nn import TensorDictParams

from ckptstore import Store


@tensorclass
class MyClass:
    X: torch.Tensor
    y: "MyClass"
    z: str


def _base(*shape, extra=()) -> TensorDict:
    return TensorDict(
        {"a": torch.randn(*extra, *shape, 5), "b": torch.randn(*extra, *shape, 10), "c": torch.randint(10, (*extra, *shape, 3))},
        batch_size=[*extra, *shape],
    )


def _nested() -> TensorDict:
    td = _base(4, 3, 2, 1)
    td["my_nested_td"] = TensorDict({"inner": torch.randn(4, 3, 2, 1, 2)}, [4, 3, 2, 1])
    return td


def _reset_bs() -> TensorDict:
    td = TensorDict({"a": torch.randn(4, 3, 2, 1, 5), "b": torch.randn(4, 3, 2, 1, 10), "c": torch.randint(10, (4, 3, 2, 1, 3))}, [4, 3, 2])
    td.batch_size = torch.Size([4, 3, 2, 1])
    return td


def _nested_tensorclass() -> TensorDict:
    td = _base(4, 3, 2, 1)
    td["my_nested_tc"] = MyClass(
        X=torch.randn(4, 3, 2, 1), y=MyClass(X=torch.randn(4, 3, 2, 1), y=None, z=None, batch_size=[4, 3, 2, 1]), z="z", batch_size=[4, 3, 2, 1]
    )
    return td


def _with_non_tensor() -> TensorDict:
    td = _base(4, 3, 2, 1)
    td.set_non_tensor(("data", "non_tensor"), "some text data")
    return td


TDS = {
    "td": lambda: _base(4, 3, 2, 1),
    "nested_td": _nested,
    "nested_tensorclass": _nested_tensorclass,
    "nested_stacked_td": lambda: LazyStackedTensorDict.lazy_stack(list(_nested().unbind(1)), 1),
    "stacked_td": lambda: LazyStackedTensorDict.lazy_stack([_base(4, 3, 1), _base(4, 3, 1)], 2),
    "idx_td": lambda: _base(4, 3, 2, 1, extra=(2,))[1],
    "sub_td": lambda: _base(4, 3, 2, 1, extra=(2,))._get_sub_tensordict(1),
    "sub_td2": lambda: _base(2, 3, 2, 1, extra=(4,))._get_sub_tensordict((slice(None), 1)),
    "memmap_td": lambda: _base(4, 3, 2, 1).memmap_(),
    "permute_td": lambda: _base(3, 1, 4, 2).permute(2, 0, 3, 1),
    "unsqueezed_td": lambda: _base(4, 3, 2).unsqueeze(-1),
    "squeezed_td": lambda: _base(4, 3, 1, 2, 1).squeeze(2),
    "td_reset_bs": _reset_bs,
    "td_params": lambda: TensorDictParams(_base(4, 3, 2, 1)),
    "td_with_non_tensor": _with_non_tensor,
}


class _Peer:
    name = "peer"

    def save(self, td, prefix: Path, num_threads: int = 0, inplace: bool = True, return_early: bool = False):
        method = td.memmap_ if inplace else td.memmap
        return method(prefix=prefix, num_threads=num_threads, copy_existing=True, **({"return_early": True} if return_early else {}))

    def load(self, cls, prefix: Path, device=None):
        return cls.load_memmap(prefix, device=device)


class _Store:
    name = "ckptstore"

    def __init__(self, root: Path):
        self.store = Store(root)

    @staticmethod
    def _tag(prefix: Path) -> str:
        return "td-" + Path(prefix).name

    def save(self, td, prefix: Path, num_threads: int = 0, inplace: bool = True, return_early: bool = False):
        if return_early:
            return _Later(self, self.store.commit_async(td, tag=self._tag(prefix)), prefix)
        self.store.commit(td, tag=self._tag(prefix))
        return td if inplace else self.load(type(td), prefix)

    def load(self, cls, prefix: Path, device=None):
        return self.store.checkout(self._tag(prefix), map_location=device)


class _Later:
    """``memmap(return_early=True)``'s future: its result is the saved copy."""

    def __init__(self, storage: _Store, future, prefix: Path):
        self.storage, self.future, self.prefix = storage, future, prefix

    def result(self):
        self.future.result()
        return self.storage.load(TensorDict, self.prefix)


@pytest.fixture(params=["peer", "ckptstore"])
def storage(request, tmp_path_factory):
    return _Peer() if request.param == "peer" else _Store(tmp_path_factory.mktemp("store") / "store")


td_names = pytest.mark.parametrize("td_name", list(TDS))
device = torch.device("cpu")


@td_names
@pytest.mark.parametrize("num_threads", [0, 2])
def test_memmap_(storage, td_name, tmpdir, num_threads):
    td = TDS[td_name]()
    if storage.name == "peer" and td_name in ("sub_td", "sub_td2"):
        with pytest.raises(RuntimeError, match="Converting a sub-tensordict values to memmap cannot be done"):
            storage.save(td, tmpdir, num_threads=num_threads)
        return
    if storage.name == "peer" and td_name in ("td_h5", "td_params"):
        with pytest.raises(RuntimeError, match="Cannot build a memmap TensorDict in-place"):
            storage.save(td, tmpdir, num_threads=num_threads)
        return
    storage.save(td, tmpdir, num_threads=num_threads)
    if storage.name == "peer":
        assert td.is_memmap(), (td, td._is_memmap)
        # This would fail if we were not filtering out unregistered sub-folders
        os.mkdir(Path(tmpdir) / "some_other_path")
    assert_allclose_td(storage.load(TensorDict, tmpdir), td)


@td_names
def test_memmap_prefix(storage, td_name, tmp_path):
    if td_name == "memmap_td":
        pytest.skip("Memmap case is redundant, functionality checked by other cases")
    td = TDS[td_name]()
    if storage.name == "peer" and td_name in ("sub_td", "sub_td2"):
        with pytest.raises(RuntimeError, match="Converting a sub-tensordict values to memmap cannot be done"):
            storage.save(td, tmp_path / "tensordict")
        return
    if storage.name == "peer" and td_name in ("td_h5", "td_params"):
        with pytest.raises(RuntimeError, match="Cannot build a memmap TensorDict in-place"):
            storage.save(td, tmp_path / "tensordict")
        return
    storage.save(td, tmp_path / "tensordict")
    # dropped: the asserts on the peer's meta.json (module docstring)
    td2 = storage.load(type(td) if storage.name == "peer" else TensorDict, tmp_path / "tensordict", device=device)
    assert (td.cpu() == td2.cpu()).all()


@td_names
def test_memmap_threads(storage, td_name, tmpdir):
    num_threads = 2
    td = TDS[td_name]()
    tdmmap = storage.save(td, Path(tmpdir) / "a", num_threads=num_threads, inplace=False)
    assert_allclose_td(td.cpu().detach(), tdmmap)
    tdfuture = storage.save(td, Path(tmpdir) / "b", num_threads=num_threads, inplace=False, return_early=True)
    assert_allclose_td(td.cpu().detach(), tdfuture.result())


@pytest.mark.parametrize("like", [True, False])
def test_save_load_memmap_stacked_td(storage, like, tmpdir):
    a = TensorDict({"a": [1]}, [])
    b = TensorDict({"b": [1]}, [])
    c = LazyStackedTensorDict.lazy_stack([a, b])
    c = c.expand(10, 2)
    if like:
        d = c.memmap_like(prefix=tmpdir) if storage.name == "peer" else c.memmap_like()
        if storage.name == "ckptstore":
            storage.save(d, tmpdir)
    else:
        d = storage.save(c, tmpdir)
    d2 = storage.load(LazyStackedTensorDict, tmpdir)
    assert (d2 == d).all()
    assert (d2[:, 0] == d[:, 0]).all()
    if like:
        assert (d2[:, 0] == a.zero_()).all()
    else:
        assert (d2[:, 0] == a).all()


def test_load_scenarios(storage, tmpdir, request):
    if storage.name == "ckptstore":
        request.applymarker(pytest.mark.xfail(strict=False, reason="issue 24 values: a tensorclass at the top level of a commit"))

    @tensorclass
    class MyClass:
        X: torch.Tensor
        td: TensorDict
        integer: int
        string: str
        dictionary: dict

    @tensorclass
    class MyOtherClass:
        Y: torch.Tensor

    data = MyClass(
        X=torch.randn(10, 3), td=TensorDict({"y": torch.randn(10)}, batch_size=[10]), integer=3, string="a string",
        dictionary={"some_data": "a"}, batch_size=[],
    )
    if storage.name == "peer":
        data.memmap_(tmpdir)
        data2 = MyClass.load_memmap(tmpdir)
    else:
        storage.save(data, tmpdir)
        target = MyClass(X=torch.zeros(10, 3), td=TensorDict({"y": torch.zeros(10)}, batch_size=[10]), integer=0, string="", dictionary={}, batch_size=[])
        data2 = storage.store.checkout(storage._tag(tmpdir), into=target)
    assert (data2 == data).all()
    if storage.name == "peer":  # dropped for ckptstore (module docstring)
        data.apply_(lambda x: x + 1)
        assert (data2 == data).all()
        data3 = MyOtherClass.load_memmap(tmpdir)
        assert isinstance(data3, MyClass)

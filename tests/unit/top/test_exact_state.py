"""What a user commits is what a user gets back.

1. Any ``str`` key round-trips (property tests over dicts, TensorDicts and
   module state dicts), and ``partial=`` addresses any key without ambiguity.
2. Optimizer state follows each parameter by name when its module is committed
   with it (property test over optimizers, declaration orders and groups).
3. Partial restores of replay buffers leave consistent buffers or are refused
   before anything changes (table over samplers, selections and targets).
"""

from __future__ import annotations

from itertools import combinations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ListStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers import (
    PrioritizedSampler,
    PrioritizedSliceSampler,
    RandomSampler,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    TensorDictMaxValueWriter,
)

import ckptstore
from ckptstore.adapters import capture
from ckptstore.errors import PartialPathError, ShapeMismatchError, TargetMismatchError
from ckptstore.layout import escape, keypath, split, unescape
from ckptstore.objects.records import ESCAPED

from tests.conftest import assert_bit_equal

# keys users and libraries choose, and the ones that collide with the store's own path syntax
SPECIAL = ["", " ", "  x ", "/", "//", "x/y", "/a", "a/", "%", "%2F", "%25", "%u", "%uD800", ".", "..", "a.b", "\x00", "\ud800", "ü", "日本", "\n"]
KEYS = st.one_of(st.sampled_from(SPECIAL), st.text(max_size=5), st.text(alphabet="%/.2F5u", max_size=5))
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def tensors_tree(depth: int = 2):
    leaf = st.integers(0, 3).map(lambda n: torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + n)
    if depth == 0:
        return st.dictionaries(KEYS, leaf, min_size=1, max_size=4)
    return st.dictionaries(KEYS, st.one_of(leaf, tensors_tree(depth - 1)), min_size=1, max_size=4)


def leaves(tree: dict, prefix: tuple = ()) -> dict[tuple, torch.Tensor]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(leaves(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def td_leaves(td) -> dict[tuple, torch.Tensor]:
    return {k if isinstance(k, tuple) else (k,): td.get(k) for k in td.keys(True, True)}


@given(KEYS)
def test_escape_is_a_bijection_onto_segments(key):
    segment = escape(key)
    assert segment and "/" not in segment
    assert unescape(segment) == key
    assert split(keypath("a", key, key)) == ("a", key, key)


def test_escapes_are_written_as_documented():
    assert [escape(k) for k in ["x/y", "", "50%", "a\x00", "\ud800", ".", "a.b"]] == ["x%2Fy", "%", "50%25", "a%00", "%uD800", ".", "a.b"]
    # a "%" that begins no escape stands for itself: paths of commits made before keys were escaped
    assert [unescape(s) for s in ["50%", "%zz", "%2f", "%u0041"]] == ["50%", "%zz", "%2f", "%u0041"]


@SETTINGS
@given(tree=tensors_tree(), name=st.integers(0, 10**9))
def test_any_str_key_of_a_dict_round_trips(store, tree, name):
    tag = f"d-{name}"
    store.commit({"state": tree}, tag=tag)
    back = store.checkout(tag)
    got = td_leaves(back)
    want = {("state",) + k: v for k, v in leaves(tree).items()}
    assert sorted(got, key=repr) == sorted(want, key=repr)
    for k, v in want.items():
        assert_bit_equal(got[k], v)
    # restoring into a dict gives the same keys, nested the same way
    target: dict = {"state": {}}
    store.checkout(tag, into=target)
    assert sorted(leaves(target["state"]), key=repr) == sorted(leaves(tree), key=repr)
    # each leaf is addressable by its keys, as a tuple or as the escaped path, and only it is read
    path, value = next(iter(want.items()))
    for sel in (path, keypath(*path)):
        part = store.checkout(tag, partial=[sel])
        assert list(td_leaves(part)) == [path]
        assert_bit_equal(part.get(path), value)


@SETTINGS
@given(tree=tensors_tree(), name=st.integers(0, 10**9))
def test_any_tensordict_round_trips_with_identical_keys(store, tree, name):
    td = TensorDict(tree, batch_size=[])
    td["empty"] = TensorDict({}, batch_size=[])
    tag = f"t-{name}"
    store.commit({"td": td}, tag=tag)
    back = store.checkout(tag)["td"]
    assert sorted(back.keys(True, False), key=repr) == sorted(td.keys(True, False), key=repr)
    for k, v in td_leaves(td).items():
        assert_bit_equal(back.get(k), v)
    into = TensorDict({}, batch_size=[])
    store.checkout(tag, into={"td": into})
    assert sorted(into.keys(True, False), key=repr) == sorted(td.keys(True, False), key=repr)


def test_dotted_key_beside_nested_key_and_batch_sizes_are_kept(store):
    td = TensorDict({"a.b": torch.zeros(4), "a": {"b": torch.ones(4)}, "deep": TensorDict({"x": torch.ones(4, 3)}, [4, 3]),
                     "none": TensorDict({}, [4, 2])}, batch_size=[4])
    store.commit(td, tag="t")
    back = store.checkout("t")
    assert_bit_equal(back["a.b"], torch.zeros(4))
    assert_bit_equal(back["a", "b"], torch.ones(4))
    assert back["deep"].batch_size == torch.Size([4, 3]) and back["none"].batch_size == torch.Size([4, 2])
    assert store.checkout("t", partial=["none"])["none"].batch_size == torch.Size([4, 2])
    assert [leaf.path for leaf in store.manifest("t")] == ["a.b", "a/b", "deep/x", "none"]


def test_module_with_slash_and_percent_in_its_names(store):
    def build():
        torch.manual_seed(0)
        m = torch.nn.Module()
        m.add_module("enc/0", torch.nn.Linear(3, 2))
        m.register_buffer("50%", torch.arange(3.0))
        return m

    m = build()
    with torch.no_grad():
        m.get_submodule("enc/0").weight.add_(1)
    store.commit({"model": m}, tag="m")
    fresh = build()
    store.checkout("m", into={"model": fresh})
    for k, v in m.state_dict().items():
        assert_bit_equal(fresh.state_dict()[k], v)
    assert sorted(leaf.path for leaf in store.manifest("m")) == ["model/50%25", "model/enc%2F0.bias", "model/enc%2F0.weight"]
    part = store.checkout("m", partial=[("model", "enc/0.weight")])
    assert list(part["model"].keys()) == ["enc/0.weight"]


def test_partial_errors_name_the_path(store):
    store.commit({"x/y": torch.ones(2)}, tag="t")
    with pytest.raises(PartialPathError, match="matches nothing"):
        store.checkout("t", partial=["x/y"])  # that is key "x", then key "y"
    with pytest.raises(PartialPathError, match="empty segment"):
        store.checkout("t", partial=["x//y"])
    with pytest.raises(PartialPathError, match="keys are str"):
        store.checkout("t", partial=[("x", 1)])
    assert_bit_equal(store.checkout("t", partial=["x%2Fy"])["x/y"], torch.ones(2))


def test_cli_shows_escaped_paths(store, tmp_path):
    store.commit({"x/y": torch.ones(2), "": torch.zeros(1)}, tag="t")
    from typer.testing import CliRunner

    from ckptstore.cli import app

    out = CliRunner().invoke(app, ["--store", str(store.root), "show", "t"]).output
    rows = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│ ") and "float32" in line]  # (no "kind" column below 120 columns)
    assert rows == ['"x/y"', '""'] and "%2F" not in out  # keys as the user wrote them, quoted where "/" or "" would mislead


# --- 2. optimizers by parameter name ---------------------------------------------------------

SHAPES = {"enc.weight": (4, 3), "enc.bias": (4,), "head.weight": (2, 4), "head.bias": (2,), "scale": (1,)}


class Net(torch.nn.Module):
    """Parameters named as in SHAPES, declared in ``order`` (a refactor reorders them)."""

    def __init__(self, order: list[str], seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.enc, self.head = torch.nn.Module(), torch.nn.Module()
        for name in order:
            owner, _, leaf = name.rpartition(".")
            target = getattr(self, owner) if owner else self
            target.register_parameter(leaf, torch.nn.Parameter(torch.randn(SHAPES[name], generator=gen)))

    def forward(self, x):
        h = torch.tanh(x @ self.enc.weight.T + self.enc.bias)
        return (h @ self.head.weight.T + self.head.bias) * self.scale


OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.01),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01, amsgrad=True),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=0.01, centered=True),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.1),
}


def split_groups(net: Net) -> list[dict]:
    """Two groups chosen by name (weights, then the rest), each in the module's declaration order."""
    named = list(net.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "lr": 0.05},
            {"params": [p for n, p in named if not n.endswith("weight")]}]


def train(net, opt, sched=None, scaler=None, steps=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(5, 3, generator=gen), torch.randn(5, 2, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if sched is not None:
            sched.step()


def by_name(net: Net, opt) -> dict[str, dict]:
    return {n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()} for n, p in net.named_parameters()}


def assert_same_by_name(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name, moments in a.items():
        assert sorted(moments) == sorted(b[name]), name
        for k, v in moments.items():
            if isinstance(v, torch.Tensor):
                assert_bit_equal(b[name][k], v)
            else:
                assert b[name][k] == v


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(OPTIMIZERS)), order=st.permutations(sorted(SHAPES)), grouped=st.booleans(), n=st.integers(0, 10**9))
def test_optimizer_state_follows_each_parameter_by_name(store, kind, order, grouped, n):
    net = Net(sorted(SHAPES))
    opt = OPTIMIZERS[kind](split_groups(net) if grouped else net.parameters())
    train(net, opt)
    store.commit({"model": net, "optim": opt}, tag=f"o-{n}")
    assert {leaf.path.split("/")[2] for leaf in store.manifest(f"o-{n}", ["optim/state"])} <= {f"model%2F{k}" for k in SHAPES}

    refactored = Net(list(order), seed=7)
    opt2 = OPTIMIZERS[kind](split_groups(refactored) if grouped else refactored.parameters())
    store.checkout(f"o-{n}", into={"model": refactored, "optim": opt2})
    assert_same_by_name(by_name(net, opt), by_name(refactored, opt2))
    # both continue identically, parameter by parameter
    train(net, opt, seed=2)
    train(refactored, opt2, seed=2)
    for name, p in net.named_parameters():
        assert_bit_equal(refactored.get_parameter(name), p)


def test_scheduler_and_grad_scaler_continue_after_a_refactor(store):
    def build(order, seed):
        net = Net(order, seed)
        opt = torch.optim.Adam(split_groups(net), lr=0.01)
        return net, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), torch.amp.GradScaler("cpu", init_scale=2.0**8)

    net, opt, sched, scaler = build(sorted(SHAPES), 0)
    train(net, opt, sched, scaler, steps=5)
    store.commit({"model": net, "optim": opt, "sched": sched, "scaler": scaler}, tag="t")
    net2, opt2, sched2, scaler2 = build(sorted(SHAPES, reverse=True), 3)
    store.checkout("t", into={"model": net2, "optim": opt2, "sched": sched2, "scaler": scaler2})
    assert sched2.get_last_lr() == sched.get_last_lr() and scaler2.get_scale() == scaler.get_scale()
    train(net, opt, sched, scaler, steps=3, seed=5)
    train(net2, opt2, sched2, scaler2, steps=3, seed=5)
    for name, p in net.named_parameters():
        assert_bit_equal(net2.get_parameter(name), p)
    assert sched2.get_last_lr() == sched.get_last_lr() and scaler2.get_scale() == scaler.get_scale()


def test_optimizer_restored_alone_finds_its_module_in_into(store):
    net = Net(sorted(SHAPES))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    train(net, opt)
    store.commit({"model": net, "optim": opt}, tag="t")
    refactored = Net(sorted(SHAPES, reverse=True), seed=9)
    before = {n: p.clone() for n, p in refactored.named_parameters()}
    opt2 = torch.optim.Adam(refactored.parameters(), lr=0.01)
    store.checkout("t", into={"model": refactored, "optim": opt2}, partial=["optim"])
    assert_same_by_name(by_name(net, opt), by_name(refactored, opt2))
    for n, p in refactored.named_parameters():  # the module was not restored
        assert_bit_equal(p, before[n])
    # without the module in into, parameters are matched by position, as load_state_dict does
    same_order = Net(sorted(SHAPES), seed=9)
    opt3 = torch.optim.Adam(same_order.parameters(), lr=0.01)
    with pytest.warns(UserWarning, match="is matched by position: the modules that own these parameters are not in into="):
        store.checkout("t", into={"optim": opt3}, partial=["optim"])
    assert_same_by_name(by_name(net, opt), by_name(same_order, opt3))


def test_optimizer_mismatches_name_the_parameter_and_change_nothing(store):
    net = Net(sorted(SHAPES))
    opt = torch.optim.Adam(split_groups(net), lr=0.01)
    train(net, opt)
    store.commit({"model": net, "optim": opt}, tag="t")

    class Wider(Net):
        def __init__(self):
            super().__init__(sorted(SHAPES))
            self.head.bias = torch.nn.Parameter(torch.zeros(3))
            self.head.weight = torch.nn.Parameter(torch.zeros(3, 4))

    cases = []
    wider = Wider()
    cases.append(({"model": wider, "optim": torch.optim.Adam(split_groups(wider), lr=0.01)}, ShapeMismatchError, r"stored \[2, 4\], the target parameter matched to model/head.weight is \[3, 4\]"))
    swapped = Net(sorted(SHAPES))
    groups = split_groups(swapped)
    groups[0]["params"].append(groups[1]["params"].pop(0))  # scale moved into the weights' group
    cases.append(({"model": swapped, "optim": torch.optim.Adam(groups, lr=0.01)}, TargetMismatchError, r"param group 0 differs: in the commit only \[\], in the target only \['model/scale'\]"))
    missing = Net(sorted(SHAPES))
    del missing.scale
    cases.append(({"model": missing, "optim": torch.optim.Adam(split_groups(missing), lr=0.01)}, TargetMismatchError, "model/scale"))
    for into, error, match in cases:
        opt_before = into["optim"].state_dict()
        params_before = {n: p.clone() for n, p in into["model"].named_parameters()}
        with pytest.raises(error, match=match):
            store.checkout("t", into=into, partial=["optim"])
        assert into["optim"].state_dict()["state"] == opt_before["state"] == {}
        for n, p in into["model"].named_parameters():
            assert_bit_equal(p, params_before[n])


def test_optimizer_over_parameters_of_no_committed_module_is_stored_by_position(store):
    free = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([free], lr=0.1, momentum=0.9)
    free.grad = torch.ones(3)
    opt.step()
    store.commit({"model": torch.nn.Linear(2, 2), "optim": opt}, tag="t")
    assert [leaf.path for leaf in store.manifest("t", ["optim/state"])] == ["optim/state/0/momentum_buffer"]
    free2 = torch.nn.Parameter(torch.ones(3))
    opt2 = torch.optim.SGD([free2], lr=0.1, momentum=0.9)
    store.checkout("t", into={"optim": opt2}, partial=["optim"])
    assert_bit_equal(opt2.state[free2]["momentum_buffer"], opt.state[free]["momentum_buffer"])


# --- 3. partial restores leave consistent replay buffers ------------------------------------

CAPACITY, ROWS, BATCH = 64, 40, 8
SAMPLERS = {
    "prioritized": lambda: PrioritizedSampler(CAPACITY, alpha=0.7, beta=0.5),
    "random": RandomSampler,
    "without_replacement": SamplerWithoutReplacement,
    "slice": lambda: SliceSampler(num_slices=2, traj_key="episode"),
    "slice_without_replacement": lambda: SliceSamplerWithoutReplacement(num_slices=2, traj_key="episode"),
    "prioritized_slice": lambda: PrioritizedSliceSampler(CAPACITY, num_slices=2, traj_key="episode", alpha=0.7, beta=0.5),
}
PARTS = ("storage", "writer", "sampler")
SELECTIONS = [c for r in (1, 2) for c in combinations(PARTS, r)]


def buffer(kind: str, rows: int, seed: int) -> TensorDictReplayBuffer:
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY), sampler=SAMPLERS[kind](), batch_size=BATCH,
                                generator=torch.Generator().manual_seed(seed))
    if rows:
        rb.extend(TensorDict({"obs": torch.arange(rows, dtype=torch.float32) + 1000 * seed, "episode": torch.arange(rows) // 10}, [rows]))
    if kind.startswith("prioritized") and rows:
        rb.update_priority(torch.arange(rows), torch.rand(rows, generator=torch.Generator().manual_seed(seed)) + 0.1)
    return rb


def state_of(rb) -> dict:
    """Every leaf of the buffer as ckptstore captures it (tensors cloned)."""
    return {path: v.clone() if isinstance(v, torch.Tensor) else v for c in capture(rb) for path, v in c.leaves.items()}


def assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert_bit_equal(b[k], v)
        else:
            assert b[k] == v, k


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_partial_restores_of_a_buffer_are_consistent_or_refused(store, kind):
    committed = buffer(kind, ROWS, seed=1)
    committed.sample()  # a started permutation / priorities in use
    store.commit({"rb": committed}, tag="t")
    want = state_of(committed)
    outcomes = []
    for selection in SELECTIONS:
        for rows in (0, ROWS, ROWS + 9):
            target = buffer(kind, rows, seed=2)
            before = state_of(target)
            needs_rows = "storage" not in selection
            try:
                store.checkout("t", into={"rb": target}, partial=[f"rb/{p}" for p in selection])
            except TargetMismatchError as exc:
                assert needs_rows and rows != ROWS, (selection, rows, exc)
                assert "check out rb/storage as well" in str(exc)
                assert_same_state(before, state_of(target))  # refused before anything changed
                outcomes.append("refused")
                continue
            assert not (needs_rows and rows != ROWS), (selection, rows)
            got = state_of(target)
            for part in selection:  # what was restored equals what was committed
                assert_same_state({k: v for k, v in want.items() if k.startswith(part)}, {k: v for k, v in got.items() if k.startswith(part)})
            if "storage" in selection and "writer" not in selection:
                assert (target._writer._cursor, target._writer._write_count) == (ROWS % CAPACITY, ROWS)
            if "storage" in selection and "sampler" not in selection and kind.startswith("prioritized"):
                # every restored row has the default priority, nothing beyond
                sampler = target._sampler
                expected = (1.0 + sampler._eps) ** sampler._alpha
                assert torch.equal(torch.as_tensor(sampler._sum_tree[torch.arange(CAPACITY)]),
                                   torch.tensor([expected] * ROWS + [0.0] * (CAPACITY - ROWS), dtype=torch.float32))
            for _ in range(3):  # usable at once: samples only filled rows, and takes new data
                index = target.sample()["index"]
                assert int(index.max()) < len(target)
            target.extend(TensorDict({"obs": torch.zeros(4), "episode": torch.full((4,), 99)}, [4]))
            assert int(target.sample()["index"].max()) < len(target)
            outcomes.append("restored")
    assert outcomes.count("refused") == 2 * 3  # writer, sampler, writer+sampler, each into 0 and ROWS + 9 rows


def test_storage_alone_into_a_max_value_writer_buffer_is_refused(store):
    def build(rows):
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(16), writer=TensorDictMaxValueWriter(rank_key="r"), batch_size=4)
        if rows:
            rb.extend(TensorDict({"r": torch.arange(rows, dtype=torch.float32)}, [rows]))
        return rb

    store.commit({"rb": build(10)}, tag="t")
    target = build(0)
    with pytest.raises(TargetMismatchError, match="TensorDictMaxValueWriter cannot be rebuilt from restored rows: check out rb/writer"):
        store.checkout("t", into={"rb": target}, partial=["rb/storage"])
    assert len(target) == 0
    store.checkout("t", into={"rb": target}, partial=["rb/storage", "rb/writer"])
    assert len(target) == 10


def test_list_storage_partial_sampler_restore_checks_rows(store):
    def build(rows):
        rb = TensorDictReplayBuffer(storage=ListStorage(16), sampler=SamplerWithoutReplacement(), batch_size=2)
        if rows:
            rb.extend(TensorDict({"x": torch.arange(rows)}, [rows]))
        return rb

    committed = build(6)
    committed.sample()
    store.commit({"rb": committed}, tag="t")
    with pytest.raises(TargetMismatchError, match="the 6 rows the commit.s did, with its capacity 16; it holds 3 of 16"):
        store.checkout("t", into={"rb": build(3)}, partial=["rb/sampler"])
    target = build(6)
    store.checkout("t", into={"rb": target}, partial=["rb/sampler"])
    assert torch.equal(target._sampler._sample_list, committed._sampler._sample_list)


# --- found by an adversarial trial -------------------------------------------------------------


def test_writer_alone_into_a_buffer_of_another_capacity_is_refused(store):
    def td(n, start):
        return TensorDict({"obs": torch.arange(start, start + n, dtype=torch.float32)}, [n])

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=4)
    rb.extend(td(13, 0))  # full, cursor 3
    store.commit({"rb": rb}, tag="t")
    target = TensorDictReplayBuffer(storage=LazyTensorStorage(50), batch_size=4)
    target.extend(td(10, 300))
    with pytest.raises(TargetMismatchError, match="with its capacity 10; it holds 10 of 50"):
        store.checkout("t", into={"rb": target}, partial=["rb/writer"])
    assert target._writer._cursor == 10


def test_two_committed_parameters_tied_in_the_target_are_refused(store):
    class T(torch.nn.Module):
        def __init__(self, tie):
            super().__init__()
            self.emb, self.out = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
            if tie:
                self.out.weight = self.emb.weight

    m = T(False)
    o = torch.optim.Adam(m.parameters())
    (m.emb.weight.sum() + 5 * m.out.weight.sum()).backward()
    o.step()
    store.commit({"model": m, "optim": o}, tag="t")
    m2 = T(True)
    o2 = torch.optim.Adam(m2.parameters())
    with pytest.raises(TargetMismatchError, match="one parameter in the target with another of its parameters"):
        store.checkout("t", into={"model": m2, "optim": o2}, partial=["optim"])
    assert o2.state_dict()["state"] == {}


def _manual_commit(store, component_meta: dict, paths: list[str], tag: str) -> str:
    """A commit whose record holds exactly these JSON leaf paths under component "td"."""
    from ckptstore.core import jsonvalue
    from ckptstore.objects.records import Component, LeafRecord

    leaves = [LeafRecord(p, "td", "json", None, None, 0, None, jsonvalue.dumps(i)) for i, p in enumerate(paths)]
    info, _ = store.commit_manifest([Component("td", "dict", 1, component_meta)], leaves, [], None, [tag], "", {}, None, 0.0)
    return info.id


def test_commits_from_before_keys_were_escaped_keep_their_keys(store):
    # such a record has no ESCAPED marker in its component meta, and its keys were stored raw
    _manual_commit(store, {"class": "builtins.dict"}, ["td/50%", "td/%25", "td/%", "td/%2F"], "old")
    back = store.checkout("old")
    assert sorted(back["td"].keys()) == ["%", "%25", "%2F", "50%"]
    assert [back["td", k] for k in ["50%", "%25", "%", "%2F"]] == [0, 1, 2, 3]
    assert list(store.checkout("old", partial=[("td", "%25")])["td"].keys()) == ["%25"]
    assert [leaf.path for leaf in store.manifest("old")] == ["td/50%25", "td/%2525", "td/%25", "td/%252F"]
    target = {"td": {}}
    store.checkout("old", into=target)
    assert target == {"td": {"50%": 0, "%25": 1, "%": 2, "%2F": 3}}
    other = ckptstore.Store(store.root.parent / "other", create=True)  # export and push keep the record, and its id
    assert store.push(other, "old").commit == other.resolve("old")
    imported = ckptstore.Store(store.root.parent / "imported", create=True)
    assert imported.import_from(store.export("old", store.root.parent / "old.zip"), tag="old").id == store.resolve("old")
    assert sorted(imported.checkout("old")["td"].keys()) == ["%", "%25", "%2F", "50%"]


def test_a_path_segment_that_is_not_escaped_canonically_is_refused(store):
    from ckptstore.errors import InvalidNameError

    for bad in (["td/%zz", "td/%25zz"], ["td/%2f"], ["td/%ud800"]):
        with pytest.raises(InvalidNameError, match="is not the escaped form of its key"):
            _manual_commit(store, {ESCAPED: True}, bad, "new")
    assert store.tags() == {}


def test_a_dict_target_is_restored_in_place_and_checked(store):
    store.commit({"cfg": {"w": torch.ones(2), "lr": 0.1}}, tag="t")
    inner, w = {"w": torch.zeros(2), "lr": 0.0, "extra": 5}, None
    w = inner["w"]
    store.checkout("t", into={"cfg": inner})
    assert inner == {"w": w, "lr": 0.1} and torch.equal(w, torch.ones(2))
    with pytest.raises(ShapeMismatchError, match=r"cfg/w: stored torch.float32 \[2\], target torch.float64 \[2\]"):
        store.checkout("t", into={"cfg": {"w": torch.zeros(2, dtype=torch.float64)}})


def test_short_hex_refs_are_not_commit_prefixes(store):
    from ckptstore.errors import RefNotFoundError

    info = store.commit({"x": torch.ones(1)})
    for short in (info.id[:1], info.id[:3]):
        with pytest.raises(RefNotFoundError):
            store.resolve(short)
    assert store.resolve(info.id[:4]) == info.id


# --- found by a second adversarial trial -------------------------------------------------------


def test_dict_targets_that_alias_memory_are_refused_before_any_change(store):
    store.commit({"d": {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([2.0, 2.0])}}, tag="d")
    t, base = torch.zeros(2), torch.zeros(4)
    shared = {"a": torch.zeros(2)}
    store.commit({"d": {"x": {"a": torch.ones(2)}, "y": {"a": torch.ones(2)}}}, tag="n")
    for ref, into, match in (
        ("d", {"d": {"a": t, "b": t}}, "share memory"),
        ("d", {"d": {"a": base[:2], "b": base[1:3]}}, "share memory"),
        ("n", {"d": {"x": shared, "y": shared}}, "twice"),
    ):
        with pytest.raises(TargetMismatchError, match=match):
            store.checkout(ref, into=into)
    assert torch.equal(t, torch.zeros(2)) and torch.equal(base, torch.zeros(4)) and torch.equal(shared["a"], torch.zeros(2))
    placeholder = {"d": {"a": torch.empty(2, device="meta"), "b": torch.zeros(2)}}
    store.checkout("d", into=placeholder)  # a meta placeholder is replaced, not "copied into"
    assert_bit_equal(placeholder["d"]["a"], torch.tensor([1.0, 1.0]))


def test_max_value_writer_alone_is_refused(store):
    def build():
        return TensorDictReplayBuffer(storage=LazyTensorStorage(10), writer=TensorDictMaxValueWriter(rank_key="reward"))

    def rows(values):
        return TensorDict({"obs": values.clone(), "reward": values.clone()}, [len(values)])

    rb = build()
    rb.extend(rows(torch.arange(15.0)))
    store.commit({"rb": rb}, tag="t")
    target = build()
    target.extend(rows(torch.arange(-100.0, -90.0)))
    with pytest.raises(TargetMismatchError, match="TensorDictMaxValueWriter restored without its storage"):
        store.checkout("t", into={"rb": target}, partial=["rb/writer"])


def test_legacy_and_escaped_components_that_read_as_one_path_are_refused(store):
    from ckptstore.core import jsonvalue
    from ckptstore.errors import InvalidNameError
    from ckptstore.objects.records import Component, LeafRecord

    comps = [Component("p%q", "dict", 1, {}), Component("p%25q", "dict", 1, {ESCAPED: True})]  # "p%q" read as "p%25q"
    leaves = [LeafRecord("p%q/x", "p%q", "json", None, None, 0, None, jsonvalue.dumps(1)),
              LeafRecord("p%25q/y", "p%25q", "json", None, None, 0, None, jsonvalue.dumps(2))]
    with pytest.raises(InvalidNameError, match="two components are one path once read"):
        store.commit_manifest(comps, leaves, [], None, ["t"], "", {}, None, 0.0)
    assert store.tags() == {}


def test_an_adapter_meta_may_not_use_the_reserved_key(store):
    from ckptstore.errors import AdapterError

    class Box:
        pass

    @ckptstore.register_adapter
    class BoxAdapter(ckptstore.Adapter):
        name, types = "test.reserved-meta-box", (Box,)

        def meta(self, obj):
            return {ESCAPED: False}

        def to_state(self, obj):
            return {"t": torch.ones(1)}

    with pytest.raises(AdapterError, match="reserves"):
        store.commit({"box": Box()}, tag="b")
    assert store.tags() == {}


def test_optimizer_of_a_torchrl_loss_module_restores_by_name(store):
    from torchrl.modules import QValueActor
    from torchrl.objectives import DQNLoss

    def build():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        loss = DQNLoss(QValueActor(net, in_keys=["obs"], action_space="one-hot"), action_space="one-hot", delay_value=True)
        return loss, torch.optim.Adam(loss.parameters(), lr=1e-2)

    td = TensorDict({"obs": torch.randn(8, 4), "action": torch.nn.functional.one_hot(torch.randint(2, (8,)), 2),
                     ("next", "obs"): torch.randn(8, 4), ("next", "reward"): torch.randn(8, 1),
                     ("next", "done"): torch.zeros(8, 1, dtype=torch.bool), ("next", "terminated"): torch.zeros(8, 1, dtype=torch.bool)}, [8])
    loss, opt = build()
    loss(td)["loss"].backward()
    opt.step()
    store.commit({"loss": loss, "optim": opt}, tag="x")
    loss2, opt2 = build()
    loss2(td)  # builds its value estimator, whose state the commit holds
    store.checkout("x", into={"loss": loss2, "optim": opt2})
    for p, q in zip(loss.parameters(), loss2.parameters()):
        assert_bit_equal(opt2.state[q]["exp_avg"], opt.state[p]["exp_avg"])

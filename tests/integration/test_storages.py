"""Storage identity (``StorageRef``) and the census passes built on it, with real CPU tensors.

``torch.frombuffer`` over one buffer makes a new storage at the *same* address every time:
the allocator's address reuse after a free, made deterministic, so that every test here
fails when storages are compared by ``data_ptr``.
"""

from __future__ import annotations

import copy
import gc
import pickle
import threading
import weakref

import numpy as np
import pytest
import torch

from cudamem.holders import census
from cudamem.holders._storages import StorageRef, matches_type, ref_of

BUFFER = bytearray(64 * 1024)


def at_buffer() -> torch.Tensor:
    """A new storage whose address is always ``BUFFER``'s."""
    return torch.frombuffer(BUFFER, dtype=torch.uint8)


def test_views_detach_and_storage_objects_share_one_identity() -> None:
    t = torch.randn(16, 16)
    refs = [ref_of(t), ref_of(t[3:]), ref_of(t.detach()), ref_of(t.t())]
    assert all(r is not None for r in refs)
    assert len(set(refs)) == 1
    assert StorageRef(t.untyped_storage()) == refs[0]
    assert ref_of(torch.randn(16, 16)) != refs[0]


def test_a_new_storage_at_the_same_address_is_another_storage() -> None:
    first = at_buffer()
    ref = ref_of(first)
    address = first.untyped_storage().data_ptr()
    del first
    gc.collect()
    second = at_buffer()
    assert second.untyped_storage().data_ptr() == address  # the scenario: address reused
    assert ref is not None and not ref.alive
    assert ref_of(second) != ref
    assert ref_of(second) in {ref_of(second)}
    assert ref not in {ref_of(second)}


def test_a_ref_keeps_no_memory_alive() -> None:
    # A numpy array backs the storage: freed exactly when the storage releases its data.
    arr = np.zeros(100_000)
    backing = weakref.ref(arr)
    t = torch.from_numpy(arr)
    ref = ref_of(t)
    del arr, t
    gc.collect()
    assert backing() is None  # the data is gone while the ref lives
    assert ref is not None and not ref.alive
    assert "freed" in repr(ref)


def test_copies_share_and_pickles_detach() -> None:
    t = torch.ones(8)
    ref = ref_of(t)
    assert ref is not None
    assert copy.copy(ref) is ref and copy.deepcopy(ref) is ref
    back = pickle.loads(pickle.dumps(ref))
    assert not back.alive and back != ref and back == back
    del back  # a detached ref frees nothing
    gc.collect()
    assert ref.alive


def test_live_storage_values_copy_and_pickle() -> None:
    keep = torch.ones(300)
    (entry,) = [s for s in census.live_tensors("cpu") if s.ref == ref_of(keep)]
    assert copy.deepcopy(entry).ref is entry.ref
    clone = pickle.loads(pickle.dumps(entry))
    assert clone.nbytes == 1200 and clone.data_ptr == entry.data_ptr
    assert clone == entry  # the ref is identity, not value: equality ignores it
    assert not clone.alive and entry.alive


def test_ref_of_refuses_what_has_no_storage() -> None:
    assert ref_of("not a tensor") is None
    assert ref_of(None) is None


def test_refs_from_many_threads() -> None:
    shared = torch.randn(64)
    target = ref_of(shared)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(300):
                own = torch.empty(32)
                assert ref_of(own) != target
                assert ref_of(shared[1:]) == target
                del own
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert target is not None and target.alive


def test_matches_type() -> None:
    assert matches_type("cuda:1", "cuda") and matches_type("cpu", None)
    assert not matches_type("cpu", "cuda")


# --------------------------------------------------------------------------- census passes


def test_live_refs_compare_across_passes_by_identity() -> None:
    kept = torch.randn(100)
    first = at_buffer()
    before = census.live_refs("cpu")
    assert before[ref_of(kept)] == ("cpu", 400)
    assert ref_of(first) in before
    del first
    gc.collect()
    second = at_buffer()
    after = census.live_refs("cpu")
    assert ref_of(kept) in after
    assert ref_of(second) in after and ref_of(second) not in before
    new = [r for r in after if r not in before]
    assert ref_of(second) in new
    assert all(r.alive for r in after)
    assert sum(not r.alive for r in before) >= 1  # the first buffer storage


def test_live_storages_among_old_refs_finds_only_survivors() -> None:
    first = at_buffer()
    survivor = torch.randn(50)
    refs = [ref_of(first), ref_of(survivor)]
    del first
    gc.collect()
    second = at_buffer()  # at the address of the first
    found = census.live_storages(holders=True, among=[r for r in refs if r is not None])
    assert [s.nbytes for s in found] == [200]
    assert any("local 'survivor'" in p for p in found[0].paths)
    assert all(s.ref != ref_of(second) for s in found)


def test_live_storages_by_device_type() -> None:
    keep = torch.ones(10)
    cpu = census.live_storages("cpu")
    assert any(s.ref == ref_of(keep) for s in cpu)
    assert all(s.device == "cpu" for s in cpu)
    assert all(s.device.startswith("cuda:") for s in census.live_storages("cuda"))


@pytest.mark.parametrize("pass_", ["live_refs", "live_storages"])
def test_census_passes_keep_nothing_alive(pass_: str) -> None:
    t = torch.randn(1000)
    w = weakref.ref(t)
    got = getattr(census, pass_)("cpu")
    del t
    gc.collect()
    assert w() is None
    del got


# --------------------------------------------------------------------------- snapshots


def test_new_since_a_freed_storage_whose_address_was_reused_is_new() -> None:
    kept = torch.randn(100)
    first = at_buffer()
    base = census.live_refs("cpu")
    del first
    gc.collect()
    second = at_buffer()  # at the first one's address
    created = torch.randn(30)
    new = census.live_refs("cpu").new_since(base)
    assert ref_of(second) in new and ref_of(created) in new
    assert ref_of(kept) not in new  # it was there at the base
    assert new[ref_of(created)] == ("cpu", 120)
    # what survived since the base: the kept storage, and not the second buffer storage
    survived = base.alive()
    assert ref_of(kept) in survived and survived[ref_of(kept)] == ("cpu", 400)
    assert all(r.alive for r in survived) and len(survived) < len(base)
    assert ref_of(second) not in survived
    del second, created


def test_new_since_does_not_depend_on_order() -> None:
    tensors = [torch.randn(n) for n in (10, 20, 30, 40)]
    both = census.StorageSnapshot.of(tensors)
    forward = census.StorageSnapshot.of(tensors[:2])
    backward = census.StorageSnapshot.of(reversed(tensors[:2]))
    assert list(forward) != list(backward) and forward == backward
    new = both.new_since(forward)
    assert new == both.new_since(backward) == census.StorageSnapshot.of(reversed(tensors[2:]))
    assert new.nbytes == 280 and len(new) == 2
    assert not forward.new_since(both)  # nothing of the smaller one is new to the larger


def test_snapshot_of_tensors_counts_each_storage_once() -> None:
    t = torch.randn(16, 16)
    snap = census.StorageSnapshot.of([t, t[3:], t.detach(), t.t(), torch.empty(0)])
    assert dict(snap) == {ref_of(t): ("cpu", 1024)}
    assert snap.nbytes == 1024


def test_snapshot_analyses_return_new_values() -> None:
    small, large, gone = torch.randn(10), torch.randn(1000), torch.randn(100)
    snap = census.StorageSnapshot.of([small, large, gone])
    del gone
    gc.collect()
    assert snap.alive() == census.StorageSnapshot.of([small, large])
    assert len(snap) == 3  # unchanged: the analysis made a new value
    assert list(snap.largest(1)) == [ref_of(large)]
    assert snap.largest(5) is snap
    assert snap.on("cpu") == snap and snap.on(None) is snap and not snap.on("cuda")
    other = census.StorageSnapshot({ref_of(small): ("cpu", 1)})
    merged = other.union(snap)
    assert merged[ref_of(small)] == ("cpu", 1) and len(merged) == 3  # its own figure wins
    assert "3 storages" in repr(snap)
    found = snap.storages(holders=True)  # the census of those still alive, largest first
    assert [s.nbytes for s in found] == [4000, 40]
    assert any("local 'large'" in p for p in found[0].paths)
    assert census.StorageSnapshot().storages() == ()


def test_storages_since_matches_new_since() -> None:
    base = census.live_refs(None)
    first = torch.randn(500)
    second = torch.randn(250)
    found, total = census.storages_since(base, limit=1)
    assert total == len(census.live_refs(None).new_since(base)) >= 2
    assert [s.ref for s in found] == [ref_of(first)]
    assert any("local 'first'" in p for p in found[0].paths)
    del first, second

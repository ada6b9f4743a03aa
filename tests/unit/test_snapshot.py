"""Snapshot files: the restricted unpickler and the cache split (CPU only)."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

import cudamem
from cudamem.allocator.cache_split import split_cache
from cudamem.allocator.snapshot import (
    UnsafeSnapshotError,
    load_snapshot,
    loads_snapshot,
    segments_of,
)

MiB = 1024**2


def plain_snapshot() -> dict[str, Any]:
    """The shape ``torch.cuda.memory._dump_snapshot()`` writes: plain data only."""
    return {
        "segments": [
            {
                "device": 0,
                "address": 0x7F0000000000,
                "total_size": 20 * MiB,
                "stream": 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "allocated_size": 4 * MiB,
                "active_size": 4 * MiB,
                "requested_size": 4 * MiB,
                "is_expandable": False,
                "blocks": [
                    {
                        "address": 0x7F0000000000,
                        "size": 4 * MiB,
                        "requested_size": 4 * MiB,
                        "state": "active_allocated",
                        "frames": [{"filename": "train.py", "line": 3, "name": "<module>"}],
                    },
                    {"address": 0x7F0000400000, "size": 16 * MiB, "state": "inactive"},
                ],
            }
        ],
        "device_traces": [[{"action": "alloc", "addr": 1, "size": 2, "stream": 0}]],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None, "max_split_size": -1.5},
        "raw": b"\x00\x01",
        "flags": [True, False, None],
    }


class _RunsCommand:
    """What a hostile snapshot looks like: unpickling calls os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_plain_snapshot_round_trips(tmp_path: Path, protocol: int) -> None:
    snap = plain_snapshot()
    if protocol < 3:
        # Protocols 0-2 spell bytes as a call to _codecs.encode, a global: refused like any
        # other. torch writes snapshots with the default protocol (>= 4).
        del snap["raw"]
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=protocol))
    assert load_snapshot(path) == snap


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    snap = plain_snapshot()
    snap["segments"][0]["frames"] = _RunsCommand(marker)
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=protocol))
    with pytest.raises(UnsafeSnapshotError, match=r"system"):
        load_snapshot(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        # builtins.eval, the classic
        b"cbuiltins\neval\n(S'1+1'\ntR.",
        # a class from a "harmless" module is refused too: no globals at all
        b"ccollections\nOrderedDict\n)R.",
    ],
)
def test_any_global_is_refused(payload: bytes) -> None:
    with pytest.raises(UnsafeSnapshotError, match="refusing to load"):
        loads_snapshot(payload)


def test_persistent_ids_are_refused() -> None:
    class P(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return "x" if obj == "secret" else None

    buf = io.BytesIO()
    P(buf).dump({"segments": ["secret"]})
    with pytest.raises(UnsafeSnapshotError):
        loads_snapshot(buf.getvalue())


def test_error_is_clear_and_public() -> None:
    assert cudamem.UnsafeSnapshotError is UnsafeSnapshotError
    assert issubclass(UnsafeSnapshotError, pickle.UnpicklingError)
    with pytest.raises(UnsafeSnapshotError) as info:
        loads_snapshot(pickle.dumps(_RunsCommand(Path("/nonexistent/x"))))
    assert "plain data only" in str(info.value)


def test_not_a_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "list.pickle"
    path.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(ValueError, match="not a memory snapshot"):
        load_snapshot(path)


def test_size_limit(tmp_path: Path) -> None:
    path = tmp_path / "big.pickle"
    path.write_bytes(pickle.dumps(plain_snapshot()))
    with pytest.raises(ValueError, match="max_bytes"):
        load_snapshot(path, max_bytes=10)
    with pytest.raises(ValueError, match="max_bytes"):
        load_snapshot(io.BytesIO(path.read_bytes()), max_bytes=10)
    assert load_snapshot(io.BytesIO(path.read_bytes()))["raw"] == b"\x00\x01"


# -- cache split -------------------------------------------------------------------------


def seg(stream: int, total: int, live: list[tuple[int, int]], device: int = 0) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [
        {"address": a, "size": s, "state": "active_allocated"} for a, s in live
    ]
    used = sum(s for _, s in live)
    if total > used:
        blocks.append({"address": 0, "size": total - used, "state": "inactive"})
    return {"device": device, "stream": stream, "total_size": total, "blocks": blocks}


def test_seed001_segment_split() -> None:
    # a 4 MiB tensor lives in a 20 MiB segment: 16 MiB cached that empty_cache cannot return
    live = split_cache([seg(0, 20 * MiB, [(0x1000, 4 * MiB)])])
    assert (live.reserved, live.live, live.cached) == (20 * MiB, 4 * MiB, 16 * MiB)
    assert (live.releasable, live.non_releasable, live.stranded) == (0, 16 * MiB, 0)
    # after del x: the whole segment is free, empty_cache returns all 20 MiB
    freed = split_cache([seg(0, 20 * MiB, [])])
    assert (freed.releasable, freed.non_releasable, freed.stranded) == (20 * MiB, 0, 0)


def test_stream_per_run_is_stranded() -> None:
    segments = [
        seg(0, 20 * MiB, [(0x1000, 4 * MiB)]),
        seg(0xA1, 40 * MiB, []),  # run 1's stream: nothing live
        seg(0xA2, 40 * MiB, []),  # run 2's stream
    ]
    split = split_cache(segments, current_streams=(0,))
    assert split.stranded == 80 * MiB
    assert [s.stream for s in split.streams if s.stranded] == [0xA1, 0xA2]
    assert split.stranded + split.releasable + split.non_releasable == split.cached
    # the current stream is never stranded, even with nothing live on it
    assert not split_cache([seg(0, 20 * MiB, [])], current_streams=(0,)).stranded


def test_stream_with_only_a_workspace_is_stranded_when_no_tensor_lives_there() -> None:
    workspace = (0xB000, 32 * MiB)
    segments = [seg(0, 20 * MiB, [(0x1000, 4 * MiB)]), seg(0xA1, 64 * MiB, [workspace])]
    without = split_cache(segments)
    assert without.stranded == 0  # a live block, and no way to tell it is not a tensor
    known = split_cache(segments, tensor_addresses={0x1000})
    assert known.stranded == 32 * MiB
    assert known.stranded_in_live_segments == 32 * MiB
    # a side stream with a live tensor (e.g. a prefetch stream) is not stranded
    assert split_cache(segments, tensor_addresses={0x1000, 0xB000}).stranded == 0


def test_segments_of_device() -> None:
    snap = {"segments": [seg(0, MiB, []), seg(0, MiB, [], device=1)]}
    assert len(segments_of(snap, 1)) == 1
    assert segments_of({"segments": None}, 0) == []
    assert split_cache(segments_of(plain_snapshot(), 0)).non_releasable == 16 * MiB


# -- what a damaged or foreign file raises ------------------------------------------------


def test_empty_file_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.pickle"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.pickle.*an empty file"):
        load_snapshot(path)
    with pytest.raises(ValueError, match="an empty file"):
        load_snapshot(io.BytesIO(b""))


def test_json_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "snap.json"
    path.write_text('{"segments": []}')
    with pytest.raises(ValueError, match=r"snap\.json.*looks like JSON") as info:
        load_snapshot(path)
    assert not isinstance(info.value, UnsafeSnapshotError)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_truncated_pickle_is_a_value_error(tmp_path: Path, protocol: int) -> None:
    snap = plain_snapshot()
    del snap["raw"]  # protocols 0-2 spell bytes as a global call (refused, see above)
    data = pickle.dumps(snap, protocol=protocol)
    path = tmp_path / "cut.pickle"
    for cut in (1, 2, 10, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cut\.pickle' is not a pickled memory snapshot"):
            load_snapshot(path)


def test_text_and_garbage_are_value_errors(tmp_path: Path) -> None:
    for i, payload in enumerate([b"hello world\n", b"\x00\xff" * 50, b"\x80\x05\x95", b"."]):
        path = tmp_path / f"bad{i}.bin"
        path.write_bytes(payload)
        with pytest.raises(ValueError, match=f"bad{i}"):
            load_snapshot(path)
    with pytest.raises(ValueError, match="the data"):
        loads_snapshot(b"not a pickle")


def test_unsafe_file_stays_unsafe_not_value_error(tmp_path: Path) -> None:
    path = tmp_path / "evil.pickle"
    path.write_bytes(b"cbuiltins\neval\n(S'1+1'\ntR.")
    with pytest.raises(UnsafeSnapshotError):
        load_snapshot(path)


def test_deeply_nested_pickle_is_refused_plainly() -> None:
    depth = 100_000  # built by opcodes, not by pickle.dumps (which would recurse)
    data = b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b"."
    with pytest.raises(ValueError, match="not a memory snapshot"):
        load_snapshot(io.BytesIO(data))


def test_wrong_argument_types() -> None:
    with pytest.raises(TypeError, match="source"):
        load_snapshot(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="source"):
        load_snapshot(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_bytes"):
        load_snapshot(io.BytesIO(b""), max_bytes="10")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_bytes"):
        load_snapshot(io.BytesIO(b""), max_bytes=True)
    with pytest.raises(ValueError, match="max_bytes"):
        load_snapshot(io.BytesIO(b""), max_bytes=-1)
    with pytest.raises(TypeError, match="binary mode"):
        load_snapshot(io.StringIO("{}"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes"):
        loads_snapshot("text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        load_snapshot(b"/tmp/x")  # type: ignore[arg-type]


def test_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_snapshot(tmp_path / "nope.pickle")


def test_not_a_snapshot_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "dict.pickle"
    path.write_bytes(pickle.dumps({"device_traces": []}))
    with pytest.raises(ValueError, match=r"dict\.pickle' is not a memory snapshot.*got dict"):
        load_snapshot(path)

"""The one JSON path: hand-built results in, plain data and documents out."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from cudamem.base.data import to_data
from cudamem.integrations.results import TrainerRelease
from cudamem.render.json import SCHEMA, to_json

from ..built import (
    MiB,
    census,
    device_ledger,
    device_release,
    device_span,
    holder,
    holders,
    live_storage,
    machine_status,
    nvml_device,
    release_result,
    run_report,
    span,
    stats,
)


def test_a_result_is_its_fields_by_their_names() -> None:
    assert to_data(holder()) == {
        "path": "__main__.saved[0]",
        "root_kind": "global",
        "root": "__main__",
        "via": "itself",
        "nbytes": 4 * MiB,
        "device": "cuda:0",
        "caller": False,
        "count": 1,
        "pattern": None,
    }


def test_nesting_tuples_and_named_tuples() -> None:
    data = to_data(holders(holder(), notes=("a note",)))
    assert data["holders"][0]["path"] == "__main__.saved[0]"
    assert data["notes"] == ["a note"]
    counters = to_data(stats(1, 3 * MiB, 4 * MiB))
    assert counters["device"] == 1 and counters["allocated"] == 3 * MiB
    assert counters["reserved"] == 4 * MiB and len(counters) == 14


def test_derived_values_a_class_names() -> None:
    d = to_data(device_span())
    assert (d["allocated_delta"], d["reserved_delta"], d["peak_delta"]) == (
        256 * MiB,
        512 * MiB,
        512 * MiB,
    )
    assert d["device"] == 0  # as the result holds it
    c = to_data(census(live_storage(8 * MiB), live_storage(512, device="cpu")))
    assert c["total"] == 8 * MiB + 512
    assert c["by_device"] == {"cuda:0": 8 * MiB, "cpu": 512}  # a method with no argument
    r = to_data(device_release())
    assert (r["freed_reserved"], r["still_allocated"], r["still_cached"]) == (
        40 * MiB,
        4 * MiB,
        16 * MiB,
    )
    assert r["nvml_freed"] == 40 * MiB
    assert r["remaining"][0]["nbytes"] == 4 * MiB


def test_one_key_per_idea_nbytes() -> None:
    ledger = to_data(device_ledger())
    assert [line["nbytes"] for line in ledger["lines"]][:2] == [615 * MiB, 518 * MiB]
    assert all("bytes" not in line for line in ledger["lines"])
    assert ledger["accounted"] == sum(
        line["nbytes"] for line in ledger["lines"] if line["nbytes"] is not None
    )
    status = to_data(machine_status(nvml_device()))
    first = status["device_lines"][0][0]
    assert first == {"label": "driver reserve", "nbytes": 615 * MiB, "frees": first["frees"]}


def test_document_has_kind_and_schema_first() -> None:
    doc = json.loads(to_json(span(), kind="cudamem.span"))
    assert list(doc)[:3] == ["kind", "schema", "name"]
    assert doc["schema"] == SCHEMA == 1
    assert doc["devices"][0]["peak"] == 612 * MiB
    assert list(json.loads(to_json(holder())))[:2] == ["schema", "path"]
    assert json.loads(to_json([holder()]))["items"][0]["path"] == "__main__.saved[0]"


def test_unicode_stays_readable_and_nan_stays_nan() -> None:
    text = to_json({"path": "__main__.d['µ→']", "v": math.nan}, indent=None)
    assert text == '{"schema": 1, "path": "__main__.d[\'µ→\']", "v": NaN}'


@dataclass(frozen=True, slots=True)
class _WithHidden:
    json_properties: ClassVar[tuple[str, ...]] = ("double",)

    value: int
    secret: object = field(default=None, metadata={"json": False})

    @property
    def double(self) -> int:
        return 2 * self.value


def test_fields_left_out_and_keys_of_mappings() -> None:
    assert to_data(_WithHidden(3, object())) == {"value": 3, "double": 6}
    assert to_data({1: (2, 3), "x": frozenset()}) == {"1": [2, 3], "x": []}


def test_anything_else_is_refused_by_name() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match="cannot render Opaque as JSON"):
        to_json({"x": Opaque()})


def test_a_release_document_is_schema_2_and_lists_live_storages() -> None:
    doc = json.loads(to_json(release_result(device_release()), kind="cudamem.release"))
    assert doc["schema"] == 2  # DeviceRelease.remaining: LiveStorage values since 2
    (storage,) = doc["devices"][0]["remaining"]
    assert storage == to_data(device_release().remaining[0])
    assert (storage["device"], storage["nbytes"], storage["pool"]) == ("cuda:0", 4 * MiB, None)
    assert [h["path"] for h in storage["holders"]["holders"]] == ["__main__.kept", "__main__.x"]
    trainer = TrainerRelease(("trainer.optimizer",), 2, 8 * MiB, 1, 4 * MiB, (), None)
    assert json.loads(to_json(trainer))["schema"] == SCHEMA == 1  # no release inside
    with_release = TrainerRelease(
        ("trainer.optimizer",), 2, 8 * MiB, 1, 4 * MiB, (), release_result(device_release())
    )
    assert json.loads(to_json(with_release))["schema"] == 2
    assert json.loads(to_json([span(), device_release()]))["schema"] == 2
    # documents without a release keep schema 1
    assert json.loads(to_json(run_report(), kind="cudamem.run"))["schema"] == 1
    assert json.loads(to_json(census(live_storage())))["schema"] == 1

"""``coordinator bench restore`` at a small size: the report's shape and that every
figure was measured beside its baselines, never its timings against a target."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import pytest

from coordinator.bench import GROUPS
from coordinator.bench.restore import MODES, _is_view_of, _Part
from coordinator.cli import main
from coordinator.participant import RestoreScope

MIB = 1 << 20
METRICS = [
    "restore.to_usable_1gib_cold",
    "restore.to_usable_vs_read_1gib_cold",
    "restore.to_usable_1gib_busy",
    "restore.peak_rss_over_state_mib",
]


def positive(values: list[Any]) -> bool:
    return bool(values) and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)


def test_restore_group_reports_each_figure_beside_its_baselines() -> None:
    assert "restore" in GROUPS
    out, err = io.StringIO(), io.StringIO()
    code = main(["bench", "restore", "--size", "32MiB", "--runs", "1", "--json"], out=out, err=err)
    assert code == 0, err.getvalue()
    assert out.getvalue().count("\n") == 1  # one JSON object
    document = json.loads(out.getvalue())
    assert document["group"] == "restore"
    results = {item["metric"]: item for item in document["results"]}
    assert list(results) == METRICS

    vs_read = results["restore.to_usable_vs_read_1gib_cold"]
    assert vs_read["detail"]["judged"] is False
    assert vs_read["baseline_name"].startswith("raw readinto")
    assert vs_read["ours"] == results["restore.to_usable_1gib_cold"]["ours"]
    for name in (METRICS[0], METRICS[2]):  # beside raw readinto + one sha256 of the same file
        item = results[name]
        assert item["unit"] == "ratio" and item["better"] == "lower"
        assert item["ours"] > 0 and item["baseline"] > 0
        assert "sha256" in item["baseline_name"]
        assert item["ratio"] == pytest.approx(item["ours"] / item["baseline"], rel=1e-3)
        assert isinstance(item["met"], bool)
        detail = item["detail"]
        assert detail["bytes"] == 32 * MIB and detail["runs"] == 1
        assert detail["file_bytes"] > detail["bytes"]
        for key in ("ours_s", "baseline_s", "read_s"):
            assert positive(detail[key]), key
        assert detail["ratio_to_read"] > 0
    assert results["restore.to_usable_1gib_busy"]["detail"]["judged"] is False

    cold = results["restore.to_usable_1gib_cold"]["detail"]
    assert positive(cold["store_read_s"])
    for mode in MODES:  # every warm figure, beside the cold ones
        assert positive(cold["warm"][f"{mode}_s"]), mode
    assert cold["warm"]["ratio_to_read_sha256"] > 0
    assert positive(cold["format_floor_s"])  # one SHA-256 pass of the file, same run
    # (> 0 only: one run of 32 MiB on a loaded machine can time the floor's one
    # pass above the baseline's read and pass; a timing is no unit test's to judge)
    assert cold["ratio_to_format_floor"] > 0 and cold["format_floor_over_baseline"] > 0
    # two passes and the raw read's own CPU over the cores: never below one pass
    assert positive(cold["cpu_floor_s"]) and cold["ratio_to_cpu_floor"] > 0
    assert all(c >= f for c, f in zip(cold["cpu_floor_s"], cold["format_floor_s"], strict=True))
    assert cold["cpu_floor_over_baseline"] >= cold["format_floor_over_baseline"]
    resident = cold["resident_before_clock"]
    if resident["cold"] != "mincore unavailable":
        assert resident["cold"][1] < 0.5 and resident["warm"][0] > 0.5  # evicted / read in
    assert cold["staging_hook"].split(":")[0] in {"used", "absent"}

    rss = results["restore.peak_rss_over_state_mib"]
    assert rss["unit"] == "MiB" and rss["baseline"] is None and rss["ratio"] is None
    assert rss["target_on"] == "ours" and math.isfinite(rss["ours"])
    assert rss["detail"]["state_mib"] == 32
    for mode in MODES:  # ours and each baseline's, every one finite
        key = "ours_mib" if mode == "resume" else f"{mode}_mib"
        assert len(rss["detail"][key]) == 1 and math.isfinite(rss["detail"][key][0]), key


@pytest.mark.asyncio
async def test_participant_adopts_its_own_buffer_and_copies_any_other_view() -> None:
    """With the staging hook the buffer it offered comes back and is adopted as it
    is; a view of other memory (a coordinator without the hook) is copied."""
    scope = RestoreScope(session_id="s", epoch="e2", checkpoint_id="e1-1", step=1)
    part = _Part("p")
    offered = part.restore_buffer(4096, scope)
    view = memoryview(offered).toreadonly()
    assert _is_view_of(view, offered)
    token = await part.stage_restore(view, scope)
    assert token is offered and part.adopted

    other = bytearray(b"x" * 4096)
    part.restore_buffer(4096, scope)
    token = await part.stage_restore(memoryview(other), scope)
    assert not part.adopted and bytes(token) == bytes(other)
    other[0] = 0
    assert bytes(token)[:1] == b"x"  # a copy, not the caller's memory
    await part.activate_restore(token)
    assert part.data is token

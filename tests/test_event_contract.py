"""The event contract in any language (issue 17): one JSON Schema (2020-12) that
Python's jsonschema, ajv in strict mode and RE2 all read the same way, exactly as
strict as docs/events.md; every JSON example in the docs valid; and the fold the
docs state in prose, followed alike by the library, the nats-py example and the
nats.js example on one real stream."""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import msgspec
import nats
import pytest
import re2
from test_examples import checkpoints_on_nats
from test_replication import replicated_run

from coordinator.events import EVENT_NAMES, Event, events_schema
from coordinator.monitor import SaveState
from coordinator.server import EmbeddedServer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCHEMA = json.loads((DOCS / "events.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
AJV_CHECK = r"""
import Ajv2020 from "ajv/dist/2020.js";
import fs from "fs";
const [schema, instances, patterns] = JSON.parse(fs.readFileSync(0, "utf8"));
const ajv = new Ajv2020({ strict: true, allErrors: true });
const validate = ajv.compile(schema);
const verdicts = instances.map((instance) => validate(instance));
const matches = patterns.map(([pattern, text]) => new RegExp(pattern, "u").test(text));
console.log(JSON.stringify({ verdicts, matches }));
"""
# Keywords of JSON Schema 2020-12 (core, applicator, validation, meta-data).
KEYWORDS = {
    "$schema", "$id", "$ref", "$defs", "$comment", "title", "description", "type", "enum",
    "const", "properties", "required", "items", "prefixItems", "oneOf", "anyOf", "allOf",
    "pattern", "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems",
    "additionalProperties", "default", "examples", "if", "then", "else", "not",
}  # fmt: skip


@pytest.fixture(scope="session")
def node() -> str:
    """The node binary, with this repository's npm packages (ajv, nats) installed."""
    binary, npm = shutil.which("node"), shutil.which("npm")
    if binary is None or npm is None:
        pytest.skip("node and npm are not installed here (CI has them)")
    # The suite's workers (pytest -n 2) each ask: one installs, the other waits for it
    # (npm ci empties node_modules first: two at once break each other's).
    tag = hashlib.sha256(bytes(ROOT)).hexdigest()[:16]
    lock = Path(tempfile.gettempdir()) / f"coordinator-npm-{tag}.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if not all((ROOT / "node_modules" / name).exists() for name in ("ajv", "nats")):
            done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=ROOT,
                                  capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
            assert done.returncode == 0, done.stderr[-2000:]
    return binary


def run_node(node: str, script: str, stdin: Any) -> Any:
    done = subprocess.run([node, "--input-type=module", "-e", script], cwd=ROOT,
                          input=json.dumps(stdin), capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every event a demo run published, as the stream holds it: all six kinds."""
    folder = tmp_path_factory.mktemp("wire")

    async def record() -> list[dict[str, Any]]:
        async with EmbeddedServer(folder / "nats") as server:
            demo = [sys.executable, "-m", "coordinator", "demo", "--nats", server.url]
            await anyio.run_process(demo, check=True)
            await replicated_run(server.url, folder / "replicated", 2)  # + replicated
            client = await nats.connect(server.url)
            events = [json.loads(data) for data in await stream_messages(client)]
            await client.close()
            return events

    events = anyio.run(record)
    assert {event["event"] for event in events} == set(EVENT_NAMES)
    return events


async def stream_messages(client: Any) -> list[bytes]:
    """Every message the CKPT stream holds, in order."""
    js = client.jetstream()
    count = (await js.stream_info("CKPT")).state.messages
    sub = await js.subscribe("ckpt.>", stream="CKPT", ordered_consumer=True)
    return [(await sub.next_msg(timeout=5)).data for _ in range(count)]


async def both_examples(url: str, node: str) -> tuple[Any, Any]:
    """The final summaries of the nats-py and the nats.js example replaying ``url``."""
    outputs = []
    for argv in ([sys.executable, str(ROOT / "examples" / "monitor_subscriber.py")],
                 [node, str(ROOT / "examples" / "monitor_subscriber.mjs")]):  # fmt: skip
        with anyio.fail_after(60):
            done = await anyio.run_process(
                [*argv, "--nats", url, "--once", "--idle", "0.5"], check=False
            )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        outputs.append(json.loads(done.stdout.decode().splitlines()[-1]))
    return outputs[0], outputs[1]


def doc_examples() -> list[dict[str, Any]]:
    """Every JSON block in docs/ that is an event."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for block in re.findall(r"```json\n(.*?)```", page.read_text(), re.S):
            value = json.loads(block)
            if isinstance(value, dict) and "event" in value:
                found.append(value)
    return found


def mutations(event: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Ways to break an event that the prose says break it."""
    broken = []
    for field in event:
        broken.append((f"without {field}", {k: v for k, v in event.items() if k != field}))
    broken += [
        ("timings null", {**event, "timings": {**event["timings"], "totalMs": None}}),
        ("time not UTC", {**event, "time": event["time"].replace("Z", "+00:00")}),
        ("eventId of another kind", {**event, "eventId": event["eventId"] + "x"}),
        ("boundary a number", {**event, "boundary": int(event["boundary"])}),
        ("sessionId with a newline", {**event, "sessionId": event["sessionId"] + "\n"}),
        ("seq negative", {**event, "seq": -1}),
    ]
    if "envelopeDigest" in event:
        abbreviated = event["envelopeDigest"][:8] + "..." + event["envelopeDigest"][-4:]
        broken.append(("digest abbreviated", {**event, "envelopeDigest": abbreviated}))
    return broken


def test_the_schema_is_2020_12_with_json_schema_keywords_only() -> None:
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert json.loads(json.dumps(events_schema())) == SCHEMA
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    keys: set[str] = set()

    def walk(value: Any, parent: str = "") -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if parent not in ("properties", "$defs"):
                    keys.add(key)
                walk(item, key)
        elif isinstance(value, list):
            for item in value:
                walk(item, parent)

    walk(SCHEMA)
    assert keys <= KEYWORDS, keys - KEYWORDS
    tags = [SCHEMA["$defs"][ref["$ref"].rsplit("/", 1)[1]]["properties"]["event"]
            for ref in SCHEMA["oneOf"]]  # fmt: skip
    assert tags == [{"const": name} for name in EVENT_NAMES]


def test_every_wire_event_is_valid_and_every_documented_break_is_not(
    wire: list[dict[str, Any]],
) -> None:
    for event in wire:
        VALIDATOR.validate(event)
    for event in [next(e for e in wire if e["event"] == kind) for kind in EVENT_NAMES]:
        for why, broken in mutations(event):
            assert not VALIDATOR.is_valid(broken), (event["event"], why)


def test_every_json_example_in_the_docs_is_valid() -> None:
    examples = doc_examples()
    assert {e["event"] for e in examples} >= {"committed", "restored"}
    for example in examples:
        VALIDATOR.validate(example)


def patterns() -> list[str]:
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "pattern":
                    found.add(item)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(SCHEMA)
    return sorted(found)


SAMPLES = ["a", "run-1", "a" * 64, "a" * 65, "A", "-a", "a\n", "run.1_x-", "0", "01",
           "18446744073709551615", "18446744073709551616", "f" * 64, "F" * 64, "",
           "run-1:e1:e1-120:committed", "2026-12-01T05:05:37.085826Z",
           "2026-12-01T05:05:37.085826+00:00", "x:y:z:restored\n"]  # fmt: skip


def test_every_pattern_means_the_same_in_python_re2_and_ecmascript(node: str) -> None:
    """RE2 compiles each pattern, and on the same strings Python's re, RE2 and
    ECMAScript (node, with the 'u' flag ajv uses) give the same verdicts. Only a
    final newline splits them (Python's ``$`` matches before it): every patterned
    string also carries ``not: {pattern: "\\n"}``, so the schema refuses one in
    all three (the mutations test checks that, under Python and ajv)."""
    pairs = [(pattern, text) for pattern in patterns() if pattern != "\\n" for text in SAMPLES]
    python = [re.search(pattern, text) is not None for pattern, text in pairs]
    google = [re2.search(pattern, text) is not None for pattern, text in pairs]
    ecmascript = run_node(node, AJV_CHECK, [SCHEMA, [], pairs])["matches"]
    assert google == ecmascript
    assert [p for p, (_, text) in zip(python, pairs, strict=True) if "\n" not in text] == [
        e for e, (_, text) in zip(ecmascript, pairs, strict=True) if "\n" not in text
    ]
    assert not any(hit for (_, text), hit in zip(pairs, ecmascript, strict=True) if "\n" in text)


def test_ajv_strict_compiles_the_schema_and_agrees_with_python(
    node: str, wire: list[dict[str, Any]]
) -> None:
    instances: list[Any] = [*wire, *doc_examples()]
    for kind in EVENT_NAMES:
        first = next(e for e in wire if e["event"] == kind)
        instances += [broken for _, broken in mutations(first)]
    instances += [{"event": "replicated", "seq": 1}, [], "committed", None]
    verdicts = run_node(node, AJV_CHECK, [SCHEMA, instances, []])["verdicts"]
    assert verdicts == [VALIDATOR.is_valid(instance) for instance in instances]
    assert sum(verdicts) == len(wire) + len(doc_examples())


def test_the_prose_the_schema_and_the_structs_name_the_same_fields(
    wire: list[dict[str, Any]],
) -> None:
    """docs/events.md's tables, the schema's properties (all required), the
    Structs' fields and the events on the wire: field for field, per kind."""
    prose = (DOCS / "events.md").read_text()
    common_rows = re.search(r"Fields every event carries:\n\n(.*?)\n\n", prose, re.S)
    assert common_rows is not None
    common = set()
    for row in common_rows.group(1).splitlines()[2:]:
        common |= set(re.findall(r"`([a-zA-Z]+)`", row.split("|")[1]))
    kinds_table = re.search(r"## The \w+ events\n\n(.*?)\n\n", prose, re.S)
    assert kinds_table is not None
    for row in kinds_table.group(1).splitlines()[2:]:
        cells = row.split("|")
        kind = re.findall(r"`([a-z]+)`", cells[1])[0]
        definition = SCHEMA["$defs"][kind.capitalize()]
        properties = set(definition["properties"])
        assert set(definition["required"]) == properties
        own = properties - common
        named = {name.split(":")[0] for name in re.findall(r"`([a-zA-Z]+(?::[^`]*)?)`", cells[3])}
        assert own <= named, (kind, own - named)
        struct = next(k for k in Event.__args__ if k.__name__.lower() == kind)  # type: ignore[attr-defined]
        assert {f.encode_name for f in msgspec.structs.fields(struct)} | {"event"} == properties
        for event in (e for e in wire if e["event"] == kind):
            assert set(event) == properties, (kind, set(event) ^ properties)
    assert common == set(SCHEMA["$defs"]["Committed"]["properties"]) - {
        "generation",
        "envelopeDigest",
        "envelopeBytes",
        "highWater",
        "durable",
    }


@pytest.mark.asyncio
async def test_the_three_folds_agree_on_one_stream(tmp_path: Path, node: str) -> None:
    """The library (``SaveState.apply_message``), the nats-py example and the nats.js
    example fold the same stream to the same state: with a missed event (a gap), a
    re-published duplicate and an event of a kind none of them knows (its seq is
    counted, not taken for a gap)."""
    async with EmbeddedServer(tmp_path / "nats") as server:
        _, high_water, history, lost = await checkpoints_on_nats(server.url, tmp_path / "store")
        client = await nats.connect(server.url)
        js = client.jetstream()
        last = history[-1]
        duplicate = msgspec.json.encode(last)
        await js.publish(f"ckpt.session-1.{type(last).__name__.lower()}", duplicate,
                         headers={"Nats-Msg-Id": "another-publication"})  # fmt: skip
        future = {"event": "replicated", "seq": last.seq + 1, "sessionId": "session-1",
                  "eventId": "session-1:e:c:replicated", "checkpointId": "ckpt-6",
                  "epoch": last.epoch}  # fmt: skip
        await js.publish("ckpt.session-1.replicated", json.dumps(future).encode())
        bad_body = {**json.loads(duplicate), "seq": last.seq + 2, "checkpointId": "C1-UPPER",
                    "eventId": "session-1:e:C1-UPPER:committed"}  # fmt: skip
        odd_time = {**json.loads(duplicate), "seq": last.seq + 3, "time": "yesterday",
                    "checkpointId": "ckpt-9", "highWater": "ckpt-9",
                    "eventId": "session-1:e:ckpt-9:committed"}  # fmt: skip
        hostile = [b"not json", b"[]", b'{"event":"captured","seq":"5"}',
                   b'{"event":"captured","seq":true,"sessionId":"session-1","eventId":"x"}',
                   json.dumps(bad_body).encode(), json.dumps(odd_time).encode()]  # fmt: skip
        # A capture the run never ends, then a new run (a crash, a restart): rule 5
        # closes it out.
        orphan = {"event": "captured", "seq": last.seq + 4, "sessionId": "session-1",
                  "eventId": "session-1:e:ckpt-10:captured", "checkpointId": "ckpt-10",
                  "epoch": last.epoch}  # fmt: skip
        next_run = {**orphan, "seq": last.seq + 5, "eventId": "session-1:run-2:ckpt-11:captured",
                    "checkpointId": "ckpt-11", "epoch": "run-2"}  # fmt: skip
        hostile += [json.dumps(orphan).encode(), json.dumps(next_run).encode()]
        for index, data in enumerate(hostile):
            await js.publish("ckpt.session-1.captured", data, headers={"Nats-Msg-Id": f"h{index}"})
        raw = await stream_messages(client)
        await client.close()
        python, javascript = await both_examples(server.url, node)
    assert python == javascript
    state = SaveState()
    for data in raw:
        state = state.apply_message(data)
    library = state.sessions["session-1"]
    folded = python["sessions"]["session-1"]
    lost_seq = json.loads(lost.data)["seq"]
    # A field the fold does not read (time) never makes a committed rule 4.
    assert folded["highWater"] == library.high_water == "ckpt-9" != high_water
    assert folded["lastSeq"] == library.last_seq == last.seq + 5
    assert state.skipped == 4
    assert folded["gaps"] == [[lost_seq, lost_seq]] and library.missing == {lost_seq}
    assert python["duplicates"] == library.duplicates == 1
    assert folded["committed"] == library.committed and folded["superseded"] == library.superseded
    assert folded["closedOut"] == library.closed_out == 1
    assert folded["inFlight"] == sorted(library.in_flight) == ["ckpt-11"]



@pytest.mark.asyncio
async def test_the_three_folds_agree_on_what_others_publish(tmp_path: Path, node: str) -> None:
    """Rules 1 and 3, on one stream, alike in the library and both examples (what
    anyone with publish rights on a session's subjects can send): no session is
    made for a sessionId that is no Id; an eventId over 259 characters is no event,
    counted on the session it names (`invalid`); a seq the session's own events
    carried, and one far from its sequence, contradict it (counted, not folded);
    16 agreeing strays in a row re-base it, and the last of them is folded. What one
    reader cannot read no reader takes: NaN, nesting past 512, UTF-16, a BOM, bad
    UTF-8, a lone surrogate; an eventId's length counts code points, not UTF-16 units."""
    async with EmbeddedServer(tmp_path / "nats") as server:
        _, high_water, history, _ = await checkpoints_on_nats(server.url, tmp_path / "store")
        last = history[-1]
        base = {"event": "captured", "sessionId": "session-1", "epoch": last.epoch}

        def captured(seq: int, name: str, **fields: Any) -> bytes:
            return json.dumps({**base, "seq": seq, "checkpointId": name,
                               "eventId": f"session-1:x:{name}:captured", **fields}).encode()  # fmt: skip

        deep = b"[" * 3000 + b"]" * 3000
        foreign = [
            captured(last.seq + 1, "c-upper", sessionId="UPPER"),  # no Id: no session
            captured(last.seq + 1, "c-long", eventId="x" * 260),  # no eventId: invalid
            captured(last.seq, "c-again"),  # a seq the session's own event carried
            captured(last.seq + 10**6, "c-far"),  # no gap the bus leaves
            # Read by no reader: they name no session (rule 1).
            captured(last.seq + 1, "c-nan", worldTime=float("nan")),  # NaN is no JSON
            captured(last.seq + 1, "c-deep").replace(b"}", b', "x": ' + deep + b"}"),
            captured(last.seq + 1, "c-600").replace(b"}", b', "x": ' + b"[" * 599 + b"]" * 599 + b"}"),
            captured(last.seq + 1, "c-utf16").decode().encode("utf-16"),
            b"\xef\xbb\xbf" + captured(last.seq + 1, "c-bom"),
            captured(last.seq + 1, "c-surrogate", reason="\ud800"),  # (a lone one)
            captured(last.seq + 1, "c-bad-utf8").replace(b"c-bad-utf8", b"c-\xff"),
            # A restored without its abandoned range: rule 4 (nats-py's KeyError).
            captured(last.seq + 1, "c-restored", event="restored", boundary="1",
                     reason="r", previousEpoch="p"),  # fmt: skip
            captured(last.seq + 2, "c-emoji", eventId="\U0001f600" * 259),  # 259 points
            # A count is read as seq is: 2.0 is 2; past 2^53 - 1 it is rule 4 (JS rounds).
            captured(last.seq + 3, "c-emoji", event="queued", queueDepth=2.0, queuedBytes="1"),
            captured(last.seq + 4, "c-huge", event="queued", queueDepth=10**400),
            captured(last.seq + 5, "c-half", event="queued", queueDepth="@").replace(
                b'"@"', b"9007199254740993.5"
            ),
            # Fields the fold does not read never make an event rule 4, whatever they hold;
            # a name given twice is read as its last value (as JSON.parse reads it).
            captured(last.seq + 6, "c-time", time="@").replace(b'"@"', b"1e400"),
            captured(last.seq + 7, "c-bigint", x="@").replace(b'"@"', b"1" + b"0" * 4300),
            captured(last.seq + 8, "c-dup").replace(
                b'"checkpointId": "c-dup"', b'"checkpointId": "not an Id", "checkpointId": "c-dup"'
            ),
            captured(last.seq + 9, "c-emoji", event="queued", queueDepth=2.5, eventId="q2.5"),
            *(captured(10**9 + i, f"c-run-{i}") for i in range(16)),  # the sequence moved
            # A flood of captures: 1024 kept in flight, the rest counted (untracked).
            *(captured(10**9 + 16 + i, f"c-flood-{i}") for i in range(1030)),
        ]
        client = await nats.connect(server.url)
        js = client.jetstream()
        for index, data in enumerate(foreign):
            await js.publish("ckpt.session-1.captured", data, headers={"Nats-Msg-Id": f"f{index}"})
        raw = await stream_messages(client)
        await client.close()
        python, javascript = await both_examples(server.url, node)
    assert python == javascript
    state = SaveState()
    for data in raw:
        state = state.apply_message(data)
    library = state.sessions["session-1"]
    folded = python["sessions"]["session-1"]
    assert set(python["sessions"]) == set(state.sessions) == {"session-1"}
    assert python["skipped"] == state.skipped == 2 + 7
    assert folded["invalid"] == library.invalid == 1
    assert folded["contradicting"] == library.contradicting == 2 + 15
    assert folded["rebased"] == library.rebased == 1
    assert folded["lastSeq"] == library.last_seq == 10**9 + 15 + 1030
    assert folded["inFlight"] == sorted(library.in_flight)
    assert {"c-emoji", "c-time", "c-bigint", "c-dup", "c-run-15"} < set(library.in_flight)
    assert len(library.in_flight) == 1024
    assert folded["untracked"] == library.untracked == 5 + 1030 - 1024
    assert folded["queueDepth"] == library.queue_depth == 1  # (2.0 capped by 1 in flight)
    assert folded["highWater"] == library.high_water == high_water  # (never moved by them)

def test_a_huge_jump_in_seq_keeps_memory_bounded() -> None:
    """seq 1, then 10**12: no gap the bus leaves (rule 3: it contradicts the
    session's sequence, and is not taken); seq 1, then 4096 further on: the fold
    keeps the newest missing numbers and counts the rest, instead of allocating
    them all (tests/test_foreign_events.py has the rest of rule 3)."""

    def event(seq: int) -> bytes:
        return json.dumps({"event": "captured", "seq": seq, "sessionId": "s",
                           "eventId": f"s:e:c{seq}:captured", "checkpointId": f"c{seq}",
                           "epoch": "e"}).encode()  # fmt: skip

    state = SaveState().apply_message(event(1)).apply_message(event(10**12))
    session = state.sessions["s"]
    assert session.missing == frozenset() and session.gaps == 0 and session.contradicting == 1
    state = state.apply_message(event(4097)).apply_message(event(8193))
    session = state.sessions["s"]
    assert len(session.missing) == 4096 and session.gaps == 8193 - 3
    assert max(session.missing) == 8192


def test_an_event_our_writer_emits_for_a_job_it_never_tried_is_valid() -> None:
    """A job the writer dropped at close, never attempted: ``attempt`` 0."""
    from test_events import make

    from coordinator.events import encode_event

    failed = msgspec.structs.replace(make("failed", 3), attempt=0)
    VALIDATOR.validate(json.loads(encode_event(failed)))


@pytest.mark.asyncio
async def test_the_node_example_follows_a_demo_like_the_python_one(
    tmp_path: Path, node: str
) -> None:
    """examples/monitor_subscriber.mjs (nats.js only) replays a `coordinator demo`
    run from a real nats-server and ends with the Python example's summary."""
    async with EmbeddedServer(tmp_path / "nats") as server:
        demo = [sys.executable, "-m", "coordinator", "demo", "--nats", server.url]
        await anyio.run_process(demo, check=True)
        python, javascript = await both_examples(server.url, node)
    assert python == javascript
    (session,) = python["sessions"].values()
    assert session["restores"] and session["committed"] > 0 and session["failed"]


@pytest.mark.asyncio
async def test_both_examples_fold_a_stream_with_no_kv_bucket(tmp_path: Path, node: str) -> None:
    """Events from a writer that may not make buckets (a stream, no CKPT_COMMITTED):
    both examples fold them, neither crashes on the missing bucket."""
    async with EmbeddedServer(tmp_path / "nats") as server:
        client = await nats.connect(server.url)
        js = client.jetstream()
        await js.add_stream(name="CKPT", subjects=["ckpt.>"])
        event = {"event": "captured", "seq": 1, "sessionId": "s", "eventId": "s:e:c1:captured",
                 "checkpointId": "c1", "epoch": "e"}  # fmt: skip
        await js.publish("ckpt.s.captured", json.dumps(event).encode())
        await client.close()
        python, javascript = await both_examples(server.url, node)
    assert python == javascript and python["sessions"]["s"]["inFlight"] == ["c1"]


@pytest.mark.asyncio
async def test_both_examples_let_no_session_speak_for_another(tmp_path: Path, node: str) -> None:
    """helper-68: a committed naming s1 on s2's subject, and one under s2's KV key,
    were s1's high water and durable state in the examples (a user narrowed to s2
    may publish both); and 300 failures with 600 KB codes kept every byte. Each
    example takes an event from its own session's subject only, a durable state
    from its own key only, and keeps the latest 16 failures, cut to 500 characters."""
    async with EmbeddedServer(tmp_path / "nats") as server:
        client = await nats.connect(server.url)
        js = client.jetstream()
        await js.add_stream(name="CKPT", subjects=["ckpt.>"])
        kv = await js.create_key_value(bucket="CKPT_COMMITTED")
        base = {"sessionId": "s1", "epoch": "e", "checkpointId": "c1"}
        forged = {**base, "event": "committed", "seq": 1, "eventId": "s1:e:c1:committed",
                  "highWater": "forged", "boundary": "9"}  # fmt: skip
        await js.publish("ckpt.s2.committed", json.dumps(forged).encode())
        await kv.put("s2", json.dumps(forged).encode())
        for seq in range(1, 41):
            failed = {**base, "event": "failed", "seq": seq, "checkpointId": f"c{seq}",
                      "eventId": f"s3:e:c{seq}:failed", "sessionId": "s3",
                      "code": "x" * 600, "reason": "y" * 600}  # fmt: skip
            await js.publish("ckpt.s3.failed", json.dumps(failed).encode())
        await client.close()
        python, javascript = await both_examples(server.url, node)
    assert python == javascript
    assert "s1" not in python["sessions"] and python["skipped"] == 1
    s3 = python["sessions"]["s3"]
    assert s3["failedCount"] == 40 and len(s3["failed"]) == 16
    assert s3["failed"][-1] == {"checkpointId": "c40", "code": "x" * 500}

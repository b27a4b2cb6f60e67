"""The storage interface (photon.storage) on a folder and on a real S3 server (SeaweedFS, photon.tools.storage_server)
behaves as one: random sequences of puts, puts-if-absent, deletes, listings from a mark and ranged reads give the same
answers on both and on a plain dict; racing writers of one key by put-if-absent leave exactly one winner on both;
a wrong key, a wrong secret, a missing object and a foreign URL are clear one-line errors; the server listens on
loopback only, keeps its key to itself (mode 600) and stops."""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from photon.storage import LocalStore, NotFoundError, S3Store, StorageError, Store, open_store
from photon.tools import storage_server

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


# Keys from a few parts, so that random operations hit the same keys, and whose order tests the listing's: "a-b/x"
# sorts before "a/x" (as S3 lists, by bytes), non-ASCII after ASCII. Two parts each: a folder cannot hold a file and a
# folder of one name ("a" and "a/b"), a bucket can; the project never writes such keys.
PARTS = st.sampled_from(["a", "a-b", "b", "ü", "x.jsonl", ".m", "20260101"])
KEYS = st.tuples(PARTS, PARTS).map("/".join)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), KEYS, st.binary(max_size=40), st.booleans()),
        st.tuples(st.just("delete"), KEYS),
        st.tuples(st.just("list"), st.sampled_from(["", "a", "a/", "a-b", "b/", "ü"]), st.one_of(st.none(), KEYS)),
        st.tuples(st.just("ranges"), KEYS, st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=3)),
        st.tuples(st.just("get"), KEYS),
    ),
    max_size=25,
)


def run(store: LocalStore | S3Store, ops: list[tuple]) -> list[object]:
    said: list[object] = []
    for op in ops:
        try:
            if op[0] == "put":
                said.append(store.put(op[1], op[2], if_absent=op[3]))
            elif op[0] == "delete":
                store.delete(op[1])
                said.append(None)
            elif op[0] == "list":
                said.append([(e.key, e.size) for e in store.listing(op[1], after=op[2])])
            elif op[0] == "ranges":
                said.append(store.get_ranges(op[1], [(s, max(s, e)) for s, e in op[2]]))
            else:
                said.append(store.get(op[1]))
        except NotFoundError:
            said.append("not found")
        except StorageError as exc:
            said.append(f"error: {type(exc).__name__}")
    return said


def model(ops: list[tuple]) -> list[object]:
    objects: dict[str, bytes] = {}
    said: list[object] = []
    for op in ops:
        if op[0] == "put":
            if op[3] and op[1] in objects:
                said.append(objects[op[1]] == op[2])  # the key holds these very bytes: this put's as much as any
                continue
            objects[op[1]] = op[2]
            said.append(True)
        elif op[0] == "delete":
            objects.pop(op[1], None)
            said.append(None)
        elif op[0] == "list":
            under = [k for k in objects if not op[1] or k.startswith(op[1].rstrip("/") + "/")]
            keys = sorted((k for k in under if op[2] is None or k > op[2]), key=str.encode)
            said.append([(k, len(objects[k])) for k in keys])
        elif op[1] not in objects:
            said.append("not found")
        elif op[0] == "ranges":
            said.append([objects[op[1]][s : max(s, e)] for s, e in op[2]])
        else:
            said.append(objects[op[1]])
    return said


EXAMPLES = int(os.environ.get("PHOTON_STORAGE_EXAMPLES", "60"))  # more for a longer hunt


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
# Found by a full run: SeaweedFS keeps a folder emptied by a delete, and listed it as an object named like the folder
@example(ops=[("put", "a-b/b", b"", False), ("delete", "a-b/b"), ("list", "a-b", None)])
def test_a_folder_and_a_bucket_answer_every_sequence_of_operations_alike(
    ops: list[tuple], bucket: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    prefix = secrets.token_hex(4)
    local = LocalStore(tmp_path_factory.mktemp("local"))
    s3 = S3Store(f"s3://{bucket}/{prefix}")
    want = model(ops)
    assert run(local, ops) == want
    assert run(s3, ops) == want


RACE = """
import sys
from photon.storage import open_store
store = open_store(sys.argv[1])
print(sum(store.put(f"race/{r}", sys.argv[2].encode(), if_absent=True) for r in range(int(sys.argv[3]))))
"""


@pytest.mark.parametrize("where", ["folder", "bucket"])
def test_racing_writers_of_a_key_by_put_if_absent_leave_exactly_one_winner(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = str(tmp_path / "store") if where == "folder" else f"s3://{request.getfixturevalue('bucket')}/p"
    rounds, writers = 30, 8
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    procs = [
        subprocess.Popen([sys.executable, "-c", RACE, url, f"w{i}", str(rounds)], env=env, stdout=subprocess.PIPE)
        for i in range(writers)
    ]
    wins = [int(p.communicate(timeout=300)[0]) for p in procs]
    assert sum(wins) == rounds, wins  # each round exactly one winner
    store = open_store(url)
    bodies = [store.get(f"race/{r}") for r in range(rounds)]
    assert all(b in {f"w{i}".encode() for i in range(writers)} for b in bodies)  # whole, one writer's
    assert sorted(e.key for e in store.listing("race/")) == sorted(f"race/{r}" for r in range(rounds))


def test_errors_are_one_line_and_name_the_store_never_the_secret(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(f"s3://{bucket}/p")
    with pytest.raises(NotFoundError, match=rf"^s3://{bucket}/p: nothing: "):
        store.get("nothing")
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError) as denied:
        open_store(f"s3://{bucket}/p").put("k", b"1")
    assert str(denied.value).startswith(f"s3://{bucket}/p: k: ") and "privileges" in str(denied.value)
    assert "\n" not in str(denied.value) and secret not in str(denied.value)
    for bad in ("", "/abs", "a//b", "a/../b", "./a"):
        with pytest.raises(StorageError, match="not a key"):
            store.put(bad, b"1")
    with pytest.raises(StorageError, match="not a folder or an s3:// URL"):
        open_store("gs://bucket/x")


def test_a_store_back_within_the_retry_budget_is_found_by_obstore_and_deltalake_alike(
    s3_server: storage_server.Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server SIGKILLed and back 6 s later, on its endpoint: a read and a Delta table's read made meanwhile
    succeed within the budget (PHOTON_STORAGE_RETRY_S, 20 s here). Found in the cluster test: with obstore's default
    count of 10 retries, a refused connection gave up after 1.5 s whatever the budget. (And `stop --hard` returned
    while the killed server could still answer: the table's read was served before it died.)"""
    import threading

    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    monkeypatch.setenv("PHOTON_STORAGE_RETRY_S", "20")
    store = open_store(f"s3://{bucket}/p")
    store.put("kept", b"kept")
    uri, options = store.delta_location("table")
    write_deltalake(uri, pa.table({"x": [1, 2]}), storage_options=options)
    restarted: list[str] = []

    def restart_in_6_s() -> threading.Thread:
        storage_server.stop(s3_server.folder, hard=True)

        def up() -> None:
            try:
                restarted.append(storage_server.start(s3_server.folder).endpoint)
            except BaseException as exc:
                restarted.append(repr(exc))

        back = threading.Timer(6.0, up)
        back.start()
        return back

    back = restart_in_6_s()
    try:
        t0 = time.monotonic()
        assert open_store(f"s3://{bucket}/p").get("kept") == b"kept"
        waited = [time.monotonic() - t0]
        back.join()
        back = restart_in_6_s()
        t0 = time.monotonic()
        assert DeltaTable(uri, storage_options=options).to_pyarrow_table()["x"].to_pylist() == [1, 2]
        waited.append(time.monotonic() - t0)
        back.join()
        # Both reads waited for their restart (a server that still answered after `stop --hard` would have served
        # them at once), and the server came back on its endpoint.
        assert restarted == [s3_server.endpoint] * 2 and min(waited) >= 5.5, (restarted, waited)
    finally:
        back.join()
        storage_server.start(s3_server.folder)


def test_a_conditional_put_rides_a_restart_and_a_lost_answer_and_the_probe_passes(
    s3_server: storage_server.Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reviewer's two breaks of put-if-absent on a sound store: right after the server restarted (3 s down, a 20 s
    budget) it failed at once ("error sending request": the client does not retry a conditional put once sent, and
    its pooled connection was dead); and with its answer lost (a proxy that forwards the request and drops the
    reply) the client's retry got 412 and the put said it had lost, so the lease start's probe refused the store."""
    import threading

    from photon.storage import check_conditional_writes
    from tests.integration.drop_proxy import DropProxy, put_create

    monkeypatch.setenv("PHOTON_STORAGE_RETRY_S", "20")
    store = open_store(f"s3://{bucket}/p")
    store.put("warm", b"x")  # a pooled connection to the server
    storage_server.stop(s3_server.folder, hard=True)
    back = threading.Timer(3.0, storage_server.start, args=(s3_server.folder,))
    back.start()
    try:
        assert store.put("after-restart", b"mine", if_absent=True)
    finally:
        back.join()
        storage_server.start(s3_server.folder)
    assert not store.put("after-restart", b"other", if_absent=True)  # another's bytes: lost, as before
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    for name, act in (
        ("lost-answer", lambda s: s.put("lost-answer/k", b"mine", if_absent=True)),
        ("probe", lambda s: check_conditional_writes(s, "probe") is None),
    ):
        proxy = DropProxy(port, put_create(rf"/{bucket}/p/"), drops=1)
        via = S3Store(f"s3://{bucket}/p", {"aws_endpoint_url": f"http://127.0.0.1:{proxy.port}"})
        assert act(via) and len(proxy.dropped) == 1, (name, proxy.dropped)
    assert store.get("lost-answer/k") == b"mine"


def test_photon_join_refuses_a_bucket_that_does_not_exist_saying_so_in_one_line(bucket: str, tmp_path: Path) -> None:
    """Newcomer walk: a missing bucket was one line ending in a cut-off "404 Not Found: <?xml ..." that never said
    the bucket was missing. For --out and --logs alike, before any registry or Spark start."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    missing = f"{bucket}-gone"
    for logs, out in ((f"s3://{bucket}/logs", f"s3://{missing}/out"), (f"s3://{missing}/logs", str(tmp_path))):
        r = subprocess.run(
            [sys.executable, "-m", "photon", "join", "--dc", "dc-a", "--logs", logs, "--out", out, "--until-caught-up"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        said = (r.stdout + r.stderr).strip().splitlines()
        where = out if missing in out else logs
        assert r.returncode == 2 and said == [
            f"error: {where}: the bucket {missing!r} does not exist on {os.environ['AWS_ENDPOINT_URL']}"
        ], said


def test_the_server_listens_on_loopback_only_keeps_its_key_private_and_stops(s3_server: storage_server.Server) -> None:
    server = storage_server.running(s3_server.folder)  # as it runs now (the module's tests restart it)
    assert server is not None and storage_server.start(server.folder) == server  # a second start finds it running
    proc = psutil.Process(server.pid)
    listening = [c.laddr for p in [proc, *proc.children(recursive=True)] for c in p.net_connections("inet")]
    listening = [a for a in listening if a]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
    cmd = proc.cmdline()
    assert "-master.telemetry=false" in cmd and "-ip.bind=127.0.0.1" in cmd
    for name in ("access-key", "secret-key", "s3.json"):
        assert (server.folder / name).stat().st_mode & 0o077 == 0, name
    assert server.env()["AWS_SECRET_ACCESS_KEY"] not in " ".join(cmd)  # never on a command line
    assert json.loads((server.folder / "server.json").read_text())["pid"] == server.pid


def test_the_server_counts_the_requests_it_answered_by_type(s3_server: storage_server.Server, bucket: str) -> None:
    server = storage_server.running(s3_server.folder)
    assert server is not None
    store = S3Store(f"s3://{bucket}/counted")
    before = storage_server.requests(server)
    assert before is not None
    store.put("a", b"1")
    store.put("b", b"2", if_absent=True)
    store.get("a")
    store.files("")
    store.move("a", "c")  # a copy, then a delete

    def grew() -> dict[str, float]:
        after = storage_server.requests(server)
        assert after is not None
        return {k: after[k]["count"] - before.get(k, {}).get("count", 0) for k in after}

    # The server counts a request once it has answered it: the count may lag the answer by a moment (a full run saw
    # the DELETE's missing right after its answer).
    deadline = time.monotonic() + 10
    while (now := grew()).get("DELETE", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert now["PUT"] == 2 and now["GET"] >= 1 and now["LIST"] >= 1, now
    assert now["COPY"] == 1 and now["DELETE"] == 1, now
    after = storage_server.requests(server)
    assert after is not None
    assert all(after[k]["seconds"] >= before.get(k, {}).get("seconds", 0) for k in after)


def test_objects_are_stored_as_put_with_their_content_type_not_compressed_by_the_server(
    s3_server: storage_server.Server, bucket: str
) -> None:
    """SeaweedFS gzips a chunk it takes for text (a JSONL log sent without a content type, or any part of a multipart
    upload) and inflates it again on every read: on this machine's two cores that cost 0.16 s of the server's CPU per
    27 MB object read, against 0.01 s stored as put."""
    import obstore

    store = S3Store(f"s3://{bucket}/typed")
    rng = random.Random(7)
    words = [secrets.token_hex(rng.randint(2, 6)) for _ in range(2_000)]
    log = b"".join(
        json.dumps({"query_id": f"q-{i}", "text": " ".join(rng.choices(words, k=6))}).encode() + b"\n"
        for i in range(120_000)
    )
    assert len(log) > 6 * 2**20  # past the client's multipart threshold (5 MiB)
    store.put("dc-a/queries/a.jsonl", log)
    store.put("state/x.parquet", b"PAR1" + bytes(100) + b"PAR1", if_absent=True)
    store.put("state/m.json", b"{}")
    types = {k: obstore.get(store._store, k).attributes.get("Content-Type")
             for k in ("dc-a/queries/a.jsonl", "state/x.parquet", "state/m.json")}  # fmt: skip
    assert types == {
        "dc-a/queries/a.jsonl": "application/x-ndjson",
        "state/x.parquet": "application/vnd.apache.parquet",
        "state/m.json": "application/json",
    }, types
    held = sum(p.stat().st_size for p in (s3_server.folder / "data").glob(f"{bucket}_*.dat"))
    assert held >= len(log), (held, len(log))  # a gzipped copy would be a third of it
    assert store.get("dc-a/queries/a.jsonl") == log


def both(bucket: str, tmp_path: Path) -> list[LocalStore | S3Store]:
    return [LocalStore(tmp_path / secrets.token_hex(4)), S3Store(f"s3://{bucket}/{secrets.token_hex(4)}")]


def test_listings_from_a_mark_and_past_a_page_are_in_byte_order_on_both(bucket: str, tmp_path: Path) -> None:
    """Review: SeaweedFS applied StartAfter per folder level (keys after the mark left out, keys before it kept) and
    listed folder by folder across 1,000-key pages ("a-b/x" after "a/0999")."""
    for store in both(bucket, tmp_path):
        for k in ("a/x", "a-b/x", "a0", "b/c/d", ".meta"):
            store.put(k, b"")
        marks = {
            "a/x": ["a0", "b/c/d"],
            "a/": ["a/x", "a0", "b/c/d"],
            "a-b/x": ["a/x", "a0", "b/c/d"],
            "b": ["b/c/d"],
        }
        for mark, want in marks.items():
            assert [e.key for e in store.listing(after=mark)] == want, (store, mark)
        assert [e.key for e in store.listing()] == [".meta", "a-b/x", "a/x", "a0", "b/c/d"], store
    s3 = S3Store(f"s3://{bucket}/{secrets.token_hex(4)}")
    keys = [f"a/{i:04d}" for i in range(1100)] + ["a-b/x", "a/z/q/r", "a0"]
    for k in keys:
        s3.put(k, b"")
    assert [e.key for e in s3.listing()] == sorted(keys, key=str.encode)
    assert [e.key for e in s3.listing("a", after="a/1098")] == ["a/1099", "a/z/q/r"]


def test_ranges_past_the_end_folders_and_odd_keys_answer_alike_on_both(bucket: str, tmp_path: Path) -> None:
    """Review: several ranges past the end made obstore panic; a folder's name read as an object raised raw OSErrors;
    a backslash was a "/" on SeaweedFS; a 240-character part overflowed the folder's temporary name."""
    answers = []
    for store in both(bucket, tmp_path):
        store.put("k", b"hello")
        store.put("d/k", b"x")
        said: list[object] = [store.get_ranges("k", [(2, 10), (7, 9)]), store.get_ranges("k", [(10, 20), (2, 100)])]
        for key in ("d", "k/x"):  # a folder's name; a name under an object
            with pytest.raises(NotFoundError):
                store.get(key)
            with pytest.raises(NotFoundError):
                store.get_ranges(key, [(0, 1)])
        said += [store.head("k/x"), store.head("d"), store.delete("d"), store.put("p" * 240, b"x")]
        for bad in ("a\\b", "a\tb", "q" * 256, "x.photon-tmp"):
            with pytest.raises(StorageError, match="not a key"):
                store.put(bad, b"1")
        with pytest.raises(StorageError, match="not a key"):
            store.child("..")
        answers.append(said)
    assert answers[0] == answers[1] == [[b"llo", b""], [b"", b"llo"], None, None, None, True]


def test_photon_storage_up_status_down_keeps_the_key_off_the_terminal_and_the_data_across_restarts(
    tmp_path: Path,
) -> None:
    """`photon storage up|status|down` as a user runs them: the AWS variables reach a shell only through env.sh (mode
    600), never stdout or stderr; an object written through them is there after a stop and a new start (the second
    start reuses the key and the endpoint); status says whether the server runs (exit 1 when not); errors are one
    line."""
    folder = tmp_path / "storage"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = f"{ROOT / 'plugins'}:{ROOT}"

    def photon(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "photon", "storage", *args, "--folder", str(folder)]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)

    try:
        up = photon("up", "--bucket", "clicks", "--bucket", "joined")
        assert up.returncode == 0, up.stdout + up.stderr
        env_sh = folder / "env.sh"
        assert f"source {env_sh}" in " ".join(up.stdout.split()) and env_sh.stat().st_mode & 0o777 == 0o600
        shell = subprocess.run(
            ["bash", "-c", f"source {env_sh} && env"], env=env, capture_output=True, text=True, check=True
        )
        aws = dict(line.split("=", 1) for line in shell.stdout.splitlines() if line.startswith("AWS_"))
        assert set(aws) >= {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"}
        assert aws["AWS_SECRET_ACCESS_KEY"] not in up.stdout + up.stderr
        status = photon("status", "--json")
        info = json.loads(status.stdout)
        assert status.returncode == 0 and info["running"] and info["endpoint"] == aws["AWS_ENDPOINT_URL"], info
        assert aws["AWS_SECRET_ACCESS_KEY"] not in status.stdout + status.stderr

        write = "from photon.storage import open_store; open_store('s3://joined/p').put('a/b.txt', b'kept')"
        subprocess.run([sys.executable, "-c", write], env=env | aws, check=True, timeout=60)
        down = photon("down")
        assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
        gone = photon("status")
        assert gone.returncode == 1 and "no local S3 server runs" in gone.stdout, gone.stdout + gone.stderr
        assert photon("down").returncode == 0  # stopping a stopped server says so and is not an error

        again = photon("up")
        assert again.returncode == 0, again.stdout + again.stderr
        aws2 = dict(
            line.split("=", 1)
            for line in subprocess.run(
                ["bash", "-c", f"source {env_sh} && env"], env=env, capture_output=True, text=True, check=True
            ).stdout.splitlines()
            if line.startswith("AWS_")
        )
        assert aws2["AWS_SECRET_ACCESS_KEY"] == aws["AWS_SECRET_ACCESS_KEY"]  # the same key after a restart
        assert aws2["AWS_ENDPOINT_URL"] == aws["AWS_ENDPOINT_URL"]  # and the same endpoint (its port was free)
        read = "from photon.storage import open_store; print(open_store('s3://joined/p').get('a/b.txt').decode())"
        got = subprocess.run([sys.executable, "-c", read], env=env | aws2, capture_output=True, text=True, timeout=60)
        assert got.stdout.strip() == "kept", got.stdout + got.stderr
        bad = photon("up", "--bucket", "X")  # not a bucket name S3 accepts
        lines = [line for line in bad.stderr.splitlines() if line.strip()]
        assert bad.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), bad.stdout + bad.stderr
    finally:
        storage_server.stop(folder, hard=True)


def test_a_server_json_naming_a_dead_zombie_or_other_process_is_no_running_server(tmp_path: Path) -> None:
    """Where nobody reaps the server once `photon storage up` exited (this sandbox's init does not), it stayed a
    zombie after `down`: status said it ran, and every `down` waited out its 10 s grace. A pid given to another
    process since is not the server either."""
    zombie = subprocess.Popen(["true"])
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
        pass
    info = {"endpoint": "http://127.0.0.1:1", "ports": {}}
    for pid, created in ((zombie.pid, None), (os.getpid(), 0.0)):
        (tmp_path / "server.json").write_text(json.dumps(info | {"pid": pid, "created": created}))
        assert storage_server.running(tmp_path) is None, pid
    zombie.wait()
    # No start time (or no pid at all): not provably the server, whatever runs under that pid (`down --hard` would
    # kill its process group: a reviewer's `sleep`); never a traceback.
    for written in (info | {"pid": os.getpid()}, {}, "not json"):
        (tmp_path / "server.json").write_text(json.dumps(written) if isinstance(written, dict) else written)
        assert storage_server.running(tmp_path) is None, written
    assert not storage_server.stop(tmp_path, hard=True)


def test_an_interrupted_start_two_starts_at_once_and_a_bad_bucket_leave_no_server_behind(tmp_path: Path) -> None:
    """A reviewer's three ways to a server nothing could stop: Ctrl-C during `up` (the server ran, unnamed in
    server.json: `status` and `down` said none ran, the next `up` failed on its locked data); two `up` at once on one
    folder (the second lost the first's lock and failed with a Go stack); a bad bucket name (checked after the start,
    the server left running)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = f"{ROOT / 'plugins'}:{ROOT}"
    folder = tmp_path / "s"
    up = [sys.executable, "-m", "photon", "storage", "up", "--folder", str(folder)]
    try:
        bad = subprocess.run([*up, "--bucket", "Bad_Bucket"], env=env, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "bucket name" in bad.stderr and storage_server.running(folder) is None
        # Ctrl-C once the server is launched and named, before it answers. Under a loaded machine this test's loop
        # can be descheduled for the whole start (CI: the start won and exited 0): that try then checks the server it
        # left is named, and the next tries until one is interrupted.
        for attempt in range(5):
            interrupted = subprocess.Popen(up, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 60
            while not (folder / "server.json").exists():  # the server launched, not answering yet
                assert interrupted.poll() is None and time.monotonic() < deadline
                time.sleep(0.01)
            interrupted.send_signal(signal.SIGINT)
            if interrupted.wait(timeout=60) == 0:
                assert storage_server.running(folder) is not None, attempt  # finished first: named, stoppable
                assert storage_server.stop(folder, hard=True)
                continue
            weeds = [
                p for p in psutil.process_iter(["cmdline"]) if str(folder / "data") in " ".join(p.info["cmdline"] or [])
            ]
            assert [p for p in weeds if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
            break
        else:
            raise AssertionError("no interrupt landed during a start in 5 tries")
        racing = [
            subprocess.Popen(
                [*up, "--bucket", "bkt"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        results = [(r.wait(timeout=120), *r.communicate()) for r in racing]
        assert [code for code, _, _ in results] == [0, 0], results
        pids = {out.split("(pid ")[1].split(")")[0] for _, out, _ in results}
        assert len(pids) == 1 and storage_server.running(folder) is not None, results  # one server, found by both
    finally:
        storage_server.stop(folder, hard=True)


MARKER_RACE = """
import json, sys
from photon.tools.completeness import Finality, write_marker
hour = 3_600_000_000
decision = Finality(start_us=hour * 490_000, end_us=hour * 490_001, final=True, decided_at_us=int(sys.argv[2]),
                    not_before_us=0, click_files=int(sys.argv[2]))
print(json.dumps(write_marker(sys.argv[1], decision)))
"""


def test_a_start_that_hangs_is_tried_again_and_one_that_fails_keeps_the_endpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review (1 restart in about 120 after a SIGKILL): weed stayed at "Volume starting" for 60 s, the start
    failed and took the remembered S3 port with it (server.json), so the next start served on another port and every
    client holding the endpoint was lost for good. A start that hangs is now tried once more; one that fails still
    leaves the endpoint for the next."""
    folder = tmp_path / "s3"
    first = storage_server.start(folder)
    storage_server.stop(folder)
    monkeypatch.setattr(storage_server, "START_TIMEOUT_S", 0.0)  # no answer in time: a hung start, twice
    with pytest.raises(storage_server.StorageServerError, match="did not start"):
        storage_server.start(folder)
    assert storage_server.running(folder) is None
    assert not [p for p in psutil.process_iter(["cmdline"]) if f"-dir={folder / 'data'}" in (p.info["cmdline"] or [])]
    monkeypatch.undo()
    again = storage_server.start(folder)
    try:
        assert again.endpoint == first.endpoint
    finally:
        storage_server.stop(folder)


@pytest.mark.parametrize("where", ["folder", "bucket"])
def test_writers_racing_to_declare_an_hour_final_agree_on_the_first_marker(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``<out>/_final/<hour>.json`` is written by put-if-absent through the storage interface, on a folder as on an
    object store: of six processes declaring one hour final at once (each with its own decision), every one returns
    the same marker, the one that stands, and a reader reads it."""
    from photon.tools.completeness import marker_path, read_marker

    out = str(tmp_path / "out") if where == "folder" else f"s3://{request.getfixturevalue('bucket')}/out"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}
    procs = [
        subprocess.Popen([sys.executable, "-c", MARKER_RACE, out, str(i + 1)], env=env, stdout=subprocess.PIPE)
        for i in range(6)
    ]
    results = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    hour = 3_600_000_000
    where_ = marker_path(out, hour * 490_000, hour * 490_001)
    assert where_.endswith("/out/_final/2025112416.json"), where_
    assert all(path == where_ for path, _ in results), results
    markers = {json.dumps(marker, sort_keys=True) for _, marker in results}
    assert len(markers) == 1, markers  # one declaration stands, whoever was first
    stood = read_marker(out, hour * 490_000, hour * 490_001)
    assert stood is not None and json.dumps(stood, sort_keys=True) in markers and stood["final"]
    assert 1 <= stood["click_files"] <= 6
    assert read_marker(out, hour * 490_001, hour * 490_002) is None  # another hour: none


def test_a_file_url_and_an_empty_path(tmp_path: Path) -> None:
    """A reviewer's finds: a ``file://`` output's marker was reported at ``file:/...`` (no such path), and an empty
    output string wrote into the current folder."""
    from photon.tools.completeness import marker_path

    hour = 3_600_000_000
    assert marker_path(f"file://{tmp_path}/out", hour, 2 * hour) == f"{tmp_path}/out/_final/1970010101.json"
    with pytest.raises(StorageError, match="empty"):
        open_store("")


def test_a_listing_from_a_mark_reads_what_lies_after_it_not_what_lies_before(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35: a batch's listing cost must be flat in the objects already in the bucket. Forty days of old
    partitions lie before the mark; the listing from it gets the keys after it and reads (objects and folder names
    the server returns) a few dozen entries, not the 400 before it; a backlog of more minute partitions than the
    fan-out after the mark is listed whole, in order, as well."""
    import obstore

    s3 = S3Store(f"s3://{bucket}/{secrets.token_hex(4)}/clicks")
    old = [f"202610{d:02d}/{m:04d}/f{i}.jsonl" for d in range(1, 21) for m in (1, 2) for i in range(10)]
    new = ["20261120/1000/a.jsonl", "20261120/1001/b.jsonl", "20261121/0000/c.jsonl"]
    backlog = [f"20261122/{m:04d}/x.jsonl" for m in range(30)]  # more than the fan-out: one listing of the day
    for k in old + new + backlog:
        s3.put(k, b"{}\n")
    read = []
    real_list, real_level = obstore.list, obstore.list_with_delimiter

    def counting_list(*args: object, **kwargs: object) -> Iterator[list[dict[str, object]]]:
        for chunk in real_list(*args, **kwargs):  # type: ignore[arg-type]
            read.extend(chunk)
            yield chunk

    def counting_level(*args: object, **kwargs: object) -> dict[str, list[object]]:
        level = real_level(*args, **kwargs)  # type: ignore[arg-type]
        read.extend(level["objects"] + level["common_prefixes"])
        return level  # type: ignore[return-value]

    monkeypatch.setattr(obstore, "list", counting_list)
    monkeypatch.setattr(obstore, "list_with_delimiter", counting_level)
    assert [e.key for e in s3.listing(after="20261120/1000")] == new + backlog
    assert len(read) < 60 + len(backlog), len(read)
    read.clear()
    assert [e.key for e in s3.listing(after="20261122/0028")] == backlog[-2:]  # a partition sorts before its keys
    assert len(read) < 60, len(read)
    assert [e.key for e in s3.listing()] == old + new + backlog


def test_a_deployments_server_serves_the_given_key_in_the_foreground_and_stops_on_sigterm(tmp_path: Path) -> None:
    """The compose file's S3 service: `photon storage up --foreground` with the key and secret its other services are
    given (PHOTON_STORAGE_*), on a fixed S3 port and the address they reach it at, its bucket made; it stays while
    the server runs and stops it on SIGTERM (`docker stop`). A start with other credentials beside it is refused."""
    port = storage_server.free_ports(1)[0]
    key, secret = "photon-compose", "change-me-" + secrets.token_hex(8)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}", "PHOTON_STORAGE_ACCESS_KEY": key}
    env["PHOTON_STORAGE_SECRET_KEY"] = secret
    folder = tmp_path / "seaweedfs"
    cmd = [sys.executable, "-m", "photon", "storage", "up", "--foreground", "--folder", str(folder), "--bucket"]
    cmd += ["photon", "--host", "localhost", "--bind", "127.0.0.1", "--s3-port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        said = proc.stdout.readline()  # after the bucket is made
        assert said.startswith(f"local S3 server at http://localhost:{port}"), said + proc.communicate()[0]
        server = storage_server.running(folder)
        assert server is not None and server.endpoint == f"http://localhost:{port}"
        weed = psutil.Process(server.pid)  # the key it serves is in s3.json only: not in its environment
        assert secret not in " ".join([*weed.cmdline(), *weed.environ().values()])
        options = {"aws_endpoint_url": f"http://localhost:{port}", "aws_access_key_id": key}
        options |= {"aws_secret_access_key": secret, "aws_region": "us-east-1"}
        store = open_store("s3://photon/x", options)
        assert store.files() == []  # the bucket exists: a missing one is an error
        store.put("probe", b"1")
        assert store.get("probe") == b"1"
        wrong = open_store("s3://photon/x", {**options, "aws_secret_access_key": "not-" + secret})
        with pytest.raises(StorageError):
            wrong.get("probe")
        other = subprocess.run(
            [*cmd[:5], "--folder", str(folder)], env={**env, "PHOTON_STORAGE_SECRET_KEY": "other"},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert other.returncode != 0 and "runs with other credentials: stop it first" in other.stdout + other.stderr
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "stopped" in out and not storage_server.alive(server.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        storage_server.stop(folder, hard=True)


def test_a_prefix_with_a_percent_sign_is_refused_in_one_line(bucket: str) -> None:
    """Review: under `s3://b/pct%41x/out` deltalake wrote and read the tables under `pctAx/out` (it reads its location
    as a URL; escaped as "%25" it decodes it twice), so the store's listing found no table where its state and logs
    were: a check found no pipeline. Refused when the store is opened."""
    with pytest.raises(StorageError, match=r"a '%' in the prefix is not supported"):
        open_store(f"s3://{bucket}/p%41q/out")
    r = subprocess.run(
        [sys.executable, "-m", "photon", "audit", "--out", f"s3://{bucket}/p%41q/out", "--manifest", "/nowhere"],
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(said) == 1 and "a '%' in the prefix is not supported" in said[0], said


def test_a_server_stopped_hard_is_gone_with_its_listeners_and_comes_back_on_its_endpoint(
    s3_server: storage_server.Server, bucket: str
) -> None:
    """Found when a lease's requests went to a dead port for their whole budget: `stop --hard` returned while the
    killed server (a Go process of many threads, its leader already a zombie) still held its S3 port, so the next
    start found the port taken and took another; every client, and every executor given the endpoint in its
    environment, then knocked on the old one. Eight rounds, each with requests made just before the kill."""
    store = open_store(f"s3://{bucket}/p")
    ports = []
    try:
        for i in range(8):
            for n in range(5):  # connections open and closing when the kill comes
                store.put(f"k{i}-{n}", b"x")
            storage_server.stop(s3_server.folder, hard=True)
            port = int(s3_server.endpoint.rsplit(":", 1)[1])
            with socket.socket() as s:  # stopped means its listener is closed: the port binds
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
            ports.append(storage_server.start(s3_server.folder).endpoint)
    finally:
        storage_server.start(s3_server.folder)
    assert ports == [s3_server.endpoint] * 8
    assert store.get("k7-4") == b"x"


def test_reads_ride_an_answer_cut_off_midway(s3_server: storage_server.Server, bucket: str) -> None:
    """Found with the S3 server SIGKILLed under readers (1 of 20 kills): a listing whose answer was cut off after its
    head failed at once ("Error getting list response body: HTTP error: request or response body error"): the
    client retries a request that got no answer, and an object's read whose body broke off, never a listing. Each
    read rides it, a listing, a listing of one level, a folder's sub-folders, a whole read and a ranged read alike,
    with its first answer cut in half by a proxy."""
    from tests.integration.drop_proxy import DropProxy

    direct = open_store(f"s3://{bucket}/p")
    for k in ("a/1", "a/2", "b/c/3"):
        direct.put(k, b"0123456789" * 100)
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    reads = {
        "listing": (lambda s: [e.key for e in s.listing()], ["a/1", "a/2", "b/c/3"]),
        "files": (lambda s: [e.key for e in s.files("a")], ["a/1", "a/2"]),
        "folders": (lambda s: s.folders(), ["a", "b"]),
        "read": (lambda s: s.read("a/1")[0], b"0123456789" * 100),
        "ranges": (lambda s: s.get_ranges("a/2", [(0, 4), (500, 510)]), [b"0123", b"0123456789"]),
    }
    for name, (act, want) in reads.items():
        proxy = DropProxy(port, lambda method, path, h: method == "GET", drops=1, cut=True)
        via = S3Store(f"s3://{bucket}/p", {"aws_endpoint_url": f"http://127.0.0.1:{proxy.port}"})
        assert act(via) == want and len(proxy.dropped) == 1, (name, proxy.dropped)


def test_every_request_rides_its_connection_reset_as_it_arrives(s3_server: storage_server.Server, bucket: str) -> None:
    """A server killed as a request reaches it resets the connection. The client tries such a request again unless
    it is a POST, and it sends a delete, even of one key, as a bulk DeleteObjects POST: CI's cluster test lost a
    lease so ("Error performing POST ...?delete ... Connection reset by peer", the S3 server SIGKILLed under a
    publish's move). Each kind of request rides its first try reset by a proxy, the store left as if made once."""
    from tests.integration.drop_proxy import DropProxy, put_create

    direct = open_store(f"s3://{bucket}/p")
    for k in ("a/1", "a/2", "b/3"):
        direct.put(k, b"0123456789" * 100)
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    method = lambda m: lambda method, path, h: method == m and h.get("if-none-match") != "*"  # noqa: E731
    acts = {
        "read": (method("GET"), lambda s: s.read("a/1")[0], b"0123456789" * 100),
        "ranges": (method("GET"), lambda s: s.get_ranges("a/2", [(0, 4), (500, 510)]), [b"0123", b"0123456789"]),
        "listing": (method("GET"), lambda s: [e.key for e in s.listing("a")], ["a/1", "a/2"]),
        "files": (method("GET"), lambda s: [e.key for e in s.files("a")], ["a/1", "a/2"]),
        "folders": (method("GET"), lambda s: s.folders(), ["a", "b"]),
        "head": (method("HEAD"), lambda s: s.head("b/3").size, 1000),
        "put": (method("PUT"), lambda s: (s.put("c/1", b"x"), s.get("c/1"))[1], b"x"),
        "put-if-absent": (
            put_create(rf"/{bucket}/p/"),
            lambda s: (s.put("d/1", b"mine", if_absent=True), s.get("d/1")),
            (True, b"mine"),
        ),
        "move": (method("PUT"), lambda s: (s.move("c/1", "c/3"), s.get("c/3"), s.head("c/1"))[1:], (b"x", None)),
        "delete": (method("POST"), lambda s: (s.delete("c/3"), s.head("c/3"))[1], None),
        "remove_all": (method("POST"), lambda s: (s.remove_all("d"), [e.key for e in s.listing("d")])[1], []),
    }
    for name, (match, act, want) in acts.items():
        proxy = DropProxy(port, match, drops=1, reset=True)
        via = S3Store(f"s3://{bucket}/p", {"aws_endpoint_url": f"http://127.0.0.1:{proxy.port}"})
        assert act(via) == want and len(proxy.dropped) == 1, (name, proxy.seen)


def test_a_store_that_stops_answering_without_a_reset_is_asked_again_within_the_budget(
    s3_server: storage_server.Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer gone without a reset (a partition, a paused machine) sends nothing and closes nothing: a request waited
    out the client's overall timeout (30 s) whatever PHOTON_STORAGE_RETRY_S said, then was not tried again (past
    the budget). Now a stalled answer is given up on within half the budget and the request tried again: each kind
    of request rides one answer held back for minutes, in a few seconds, as a store back within the budget does.
    deltalake too (its option "timeout", the only bound it takes): a table's read and a publish's commit failed
    after 30 s, the commit as a lease's error (seen under a store SIGKILLed again and again: "operation timed
    out")."""
    from photon.logs.schemas import QUARANTINE, QUARANTINE_SCHEMA
    from photon.logs.tables import OutputTable, append_rows
    from tests.integration.drop_proxy import DropProxy, put_create

    monkeypatch.setenv("PHOTON_STORAGE_RETRY_S", "4")
    direct = open_store(f"s3://{bucket}/p")
    for k in ("a/1", "a/2"):
        direct.put(k, b"0123456789" * 100)
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    get = lambda method, path, h: method == "GET"  # noqa: E731

    def rows(b: int) -> pa.Table:
        cols = {"pipeline": ["t"], "kind": ["clicks"], "file": ["f"], "line": [0], "raw": [b"x"], "raw_bytes": [1]}
        return pa.table(cols | {"reason": ["r"], "decided_at_us": [b]}, schema=QUARANTINE_SCHEMA)

    def batches(store: Store) -> list[int]:
        return sorted(OutputTable.at(store, QUARANTINE).table().to_pyarrow_table()["decided_at_us"].to_pylist())

    acts = {
        "read": (get, lambda s: s.read("a/1")[0], b"0123456789" * 100),
        "ranges": (get, lambda s: s.get_ranges("a/2", [(0, 4), (500, 510)]), [b"0123", b"0123456789"]),
        "listing": (get, lambda s: [e.key for e in s.listing()], ["a/1", "a/2"]),
        "put": (lambda m, p, h: m == "PUT", lambda s: (s.put("b/1", b"x"), s.get("b/1"))[1], b"x"),
        "put-if-absent": (put_create(rf"/{bucket}/p/"), lambda s: s.put("c/1", b"mine", if_absent=True), True),
        "table-read": (
            lambda m, p, h: m == "GET" and "/_delta_log/" in p,
            lambda s: (append_rows(direct.child("t"), QUARANTINE, rows(1), 1), batches(s.child("t")))[1],
            [1],
        ),
        "table-commit": (
            put_create(r"/u/quarantine/_delta_log/0+1\.json"),  # a table of its own: publishers' tables are cached
            lambda s: (append_rows(s.child("u"), QUARANTINE, rows(2), 2), batches(direct.child("u")))[1],
            [2],
        ),
    }
    for name, (match, act, want) in acts.items():
        proxy = DropProxy(port, match, drops=1, hang=300)
        via = S3Store(f"s3://{bucket}/p", {"aws_endpoint_url": f"http://127.0.0.1:{proxy.port}"})
        t0 = time.monotonic()
        assert act(via) == want and len(proxy.dropped) == 1, (name, proxy.dropped)
        assert time.monotonic() - t0 < 4, (name, time.monotonic() - t0)
    assert direct.get("c/1") == b"mine"


def test_table_opens_and_a_first_publish_ride_a_delta_log_listing_cut_off_midway(
    s3_server: storage_server.Server, bucket: str
) -> None:
    """Found by the review (a proxy cutting the first listing of a table's `_delta_log` in half): a lease failed at
    once (exit 2, "end of file before message length reached") at its start (its tables made or opened) and at its
    first publish (the table opened before the retried commit): deltalake tries a request that got no answer again,
    never a listing whose body broke off. Each rides it now: making and opening the tables, a first publish in a
    process, a read."""
    from photon.logs.schemas import QUARANTINE, QUARANTINE_SCHEMA
    from photon.logs.tables import append_rows, ensure_tables, published_batch
    from tests.integration.drop_proxy import DropProxy

    prefix = f"s3://{bucket}/cut-{secrets.token_hex(3)}"  # a process's publisher keeps a table open per URL
    rows = {
        "pipeline": ["p"], "kind": ["clicks"], "file": ["f"], "line": [0], "raw": [b"x"], "raw_bytes": [1],
        "reason": ["r"], "decided_at_us": [1],
    }  # fmt: skip
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    acts = {
        "create the tables": lambda s: ensure_tables(s),
        "open the tables": lambda s: ensure_tables(s),
        "a first publish": lambda s: append_rows(s, QUARANTINE, pa.table(rows, schema=QUARANTINE_SCHEMA), 1),
        "read a table": lambda s: published_batch(s, QUARANTINE) == 1 or pytest.fail("batch 1 not published"),
    }
    for name, act in acts.items():
        # Making a table lists its log from the start (no `start-after`): that listing is cut, not the open's.
        fresh = name == "create the tables"

        def delta_log(method: str, path: str, h: dict[str, str], fresh: bool = fresh) -> bool:
            listing = "list-type" in path and "_delta_log" in path
            return method == "GET" and (listing and "start-after" not in path if fresh else "_delta_log" in path)

        proxy = DropProxy(port, delta_log, drops=1, cut=True)
        act(S3Store(prefix, {"aws_endpoint_url": f"http://127.0.0.1:{proxy.port}"}))
        assert len(proxy.dropped) == 1, (name, proxy.dropped)


def test_a_publish_with_the_store_gone_past_the_budget_fails_in_one_storage_error(
    s3_server: storage_server.Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI: the S3 server down past the budget while a Delta commit read the table's log: deltalake raised a DeltaError
    ("Error interacting with object store"), not an OSError, and the lease died with a traceback (exit 1) instead of
    its one line naming the store (exit 2). Any of the publish's reads of the log, unanswered past the budget, is a
    StorageError naming the table."""
    from photon.logs.schemas import QUARANTINE, QUARANTINE_SCHEMA
    from photon.logs.tables import append_rows
    from tests.integration.drop_proxy import DropProxy

    monkeypatch.setenv("PHOTON_STORAGE_RETRY_S", "1")
    prefix = f"s3://{bucket}/gone-{secrets.token_hex(3)}"
    rows = {
        "pipeline": ["p"], "kind": ["clicks"], "file": ["f"], "line": [0], "raw": [b"x"], "raw_bytes": [1],
        "reason": ["r"], "decided_at_us": [1],
    }  # fmt: skip
    listings: list[str] = []

    def after_the_first(method: str, path: str, h: dict[str, str]) -> bool:
        if "list-type" in path and "_delta_log" in path and "start-after" in path:
            listings.append(path)
            return len(listings) > 1  # the commit's read of the table passes; the commit's own read gets no answer
        return False

    proxy = DropProxy(int(s3_server.endpoint.rsplit(":", 1)[1]), after_the_first, drops=0)
    via = S3Store(prefix, {"aws_endpoint_url": f"http://127.0.0.1:{proxy.port}"})
    append_rows(via, QUARANTINE, pa.table(rows, schema=QUARANTINE_SCHEMA), 1)  # the table open in this process
    proxy.drops_left = 1_000_000
    with pytest.raises(StorageError, match=f"{prefix}/quarantine: "):
        append_rows(via, QUARANTINE, pa.table(rows, schema=QUARANTINE_SCHEMA), 2)
    assert proxy.dropped


def test_a_publish_whose_stage_lists_short_never_publishes_less(
    s3_server: storage_server.Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the test below, in two full runs of two: a stage listed empty just after its adds record was put
    (acknowledged), the S3 server SIGKILLed around it; the publish took it for "nothing staged", committed nothing and
    removed the stage: the batch lost. A publish told what its tasks staged (a lease, a lease start and the verifier:
    from its tasks' counts) lists the stage again until it holds that much, and fails in one line when it never does,
    the table unchanged. A proxy answers the stage's listing as if it held nothing: once, then every time."""
    from photon.logs.schemas import QUARANTINE, QUARANTINE_SCHEMA
    from photon.logs.tables import OutputTable, StageShortError, publish_batch, stage_rows
    from tests.integration.drop_proxy import DropProxy

    monkeypatch.setenv("PHOTON_STORAGE_RETRY_S", "3")
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    adds = lambda method, path, h: method == "GET" and "_adds" in urllib.parse.unquote(path)  # noqa: E731

    def rows(b: int) -> pa.Table:
        cols = {"pipeline": ["t"], "kind": ["clicks"], "file": ["f"], "line": [0], "raw": [b"x"], "raw_bytes": [1]}
        return pa.table(cols | {"reason": ["r"], "decided_at_us": [b]}, schema=QUARANTINE_SCHEMA)

    def batches() -> list[int]:
        table = OutputTable.at(open_store(f"s3://{bucket}/out/t"), QUARANTINE).table()
        return sorted(table.to_pyarrow_table()["decided_at_us"].to_pylist())

    for b, drops in ((1, 1), (2, 10_000)):
        proxy = DropProxy(port, adds, drops=drops, empty=True)
        via = S3Store(f"s3://{bucket}/out/t", {"aws_endpoint_url": f"http://127.0.0.1:{proxy.port}"})
        staged = stage_rows(via, QUARANTINE, f"_staging/b{b}", "t0", rows(b), b)
        if b == 1:
            publish_batch(via, "t", b, f"_staging/b{b}", expect={QUARANTINE: staged})
        else:
            with pytest.raises(StageShortError, match="the stage lists 0 quarantine rows of the 1 its tasks staged"):
                publish_batch(via, "t", b, f"_staging/b{b}", expect={QUARANTINE: staged})
        assert proxy.dropped, b
    assert batches() == [1]


def test_a_publish_told_what_was_staged_finds_a_batch_already_published_and_its_stage_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publisher that died after its tables took the batch and its stage was removed, before the batch was marked
    published: the next publish (a lease start, the verifier), told the rows the batch committed, finds the stage
    empty and the table holding the batch: "already", nothing committed again; a batch the table lacks is refused."""
    from photon.logs.schemas import QUARANTINE, QUARANTINE_SCHEMA
    from photon.logs.tables import OutputTable, StageShortError, append_rows, publish_batch

    monkeypatch.setenv("PHOTON_STORAGE_RETRY_S", "1")
    root = LocalStore(tmp_path / "out" / "t")
    cols = {"pipeline": ["t"], "kind": ["clicks"], "file": ["f"], "line": [0], "raw": [b"x"], "raw_bytes": [1]}
    append_rows(root, QUARANTINE, pa.table(cols | {"reason": ["r"], "decided_at_us": [1]}, schema=QUARANTINE_SCHEMA), 1)
    assert publish_batch(root, "t", 1, "_staging/gone", expect={QUARANTINE: 1})[QUARANTINE] == "already"
    with pytest.raises(StageShortError, match="the stage lists 0 quarantine rows of the 1 its tasks staged"):
        publish_batch(root, "t", 2, "_staging/gone", expect={QUARANTINE: 1})
    assert OutputTable.at(root, QUARANTINE).table().to_pyarrow_table()["batch"].to_pylist() == [1]


def test_a_batch_never_takes_a_log_file_for_read_without_its_tasks_marker(
    s3_server: storage_server.Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage-1 task says in a marker which log files it read and which it left for later; the driver commits the
    batch's files as consumed from them. A marker the stage's listing misses (as the adds' listing missed one under a
    store SIGKILLed again and again) would have a file left for later, or its size as read, taken for nothing: the
    markers are listed again until every log file of the batch is named, else the batch fails in one line."""
    from photon.joiner.tasks import MarkersMissingError, _write_read_marker, read_markers
    from tests.integration.drop_proxy import DropProxy

    monkeypatch.setenv("PHOTON_STORAGE_RETRY_S", "2")
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    store = S3Store(f"s3://{bucket}/out/t")
    _write_read_marker(store, "st", "t0", [["clicks", "p/b.jsonl"]], {"queries/p/a.jsonl": [5, "e", None]}, 3, 2, [])
    _write_read_marker(store, "st", "t1", [], {"clicks/p/c.jsonl": [7, "f", None]}, 0, 1, [])
    logs = [("queries", "p/a.jsonl"), ("clicks", "p/b.jsonl"), ("clicks", "p/c.jsonl")]
    marked = lambda method, path, h: method == "GET" and "_read" in urllib.parse.unquote(path)  # noqa: E731
    for drops in (1, 10_000):
        proxy = DropProxy(port, marked, drops=drops, empty=True)
        via = S3Store(store.url, {"aws_endpoint_url": f"http://127.0.0.1:{proxy.port}"})
        if drops == 1:
            found = read_markers(via, "st", logs)
            assert (found.skipped, found.indexed, found.quarantined) == ({("clicks", "p/b.jsonl")}, 3, 3)
            assert found.read == {("queries", "p/a.jsonl"): (5, "e", None), ("clicks", "p/c.jsonl"): (7, "f", None)}
        else:
            with pytest.raises(MarkersMissingError, match=r"names clicks/p/b.jsonl or 2 more file\(s\) of the batch"):
                read_markers(via, "st", logs)
        assert proxy.dropped, drops
    with pytest.raises(MarkersMissingError, match=r"no task's read marker names clicks/p/d.jsonl of the batch"):
        read_markers(store, "st", [*logs, ("clicks", "p/d.jsonl")])


def test_a_batch_s_index_files_are_published_by_the_names_its_tasks_gave_not_by_a_listing(
    s3_server: storage_server.Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's EventStore index files, staged by its tasks, move into the pipeline's state when it is published; a
    listing of the stage that missed one (as the adds' listing missed one under a store SIGKILLed again and again)
    left it behind, and the stage's removal then deleted it: its queries lost to every later lookup. They are moved
    by the names the tasks gave in their read markers: the lease's from its markers, a lease start's or the
    verifier's from the markers that name the queries the batch committed. A proxy answers every listing of the
    stage's index folder as if it held nothing."""
    from photon.joiner.eventstore import write_index
    from photon.joiner.publish import IndexMissingError, publish_files, stage_key
    from photon.joiner.tasks import _write_read_marker
    from tests.integration.drop_proxy import DropProxy

    monkeypatch.setenv("PHOTON_STORAGE_RETRY_S", "1")
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    markers_listed = [-1]  # armed (0) for the lease start's publish only

    def listed_short(method: str, path: str, h: dict[str, str]) -> bool:
        """Every listing of the stage's index folder, and the first of its markers (a lease start lists them
        again until they name the queries the batch indexed)."""
        path = urllib.parse.unquote(path)
        if method == "GET" and "list-type" in path and "_read" in path and markers_listed[0] >= 0:
            markers_listed[0] += 1
            return markers_listed[0] == 1
        return method == "GET" and "eventstore" in path

    proxy = DropProxy(port, listed_short, drops=10_000, empty=True)
    direct = S3Store(f"s3://{bucket}/out/t")
    via = S3Store(direct.url, {"aws_endpoint_url": f"http://127.0.0.1:{proxy.port}"})
    now = int(time.time()) * 1_000_000
    index = pa.table(
        {
            "query_id": pa.array([f"127.0.0.1-1-{now + i}" for i in range(6)]).dictionary_encode(),
            "ts_us": pa.array([now + i * 3_600_000_000 for i in range(6)], pa.int64()),
            "file": pa.array(["p/q.jsonl"] * 6).dictionary_encode(),
            "offset": pa.array(range(6), pa.int64()),
            "length": pa.array([1] * 6, pa.int32()),
        }
    )
    for batch, how in ((1, "lease"), (2, "lease start"), (3, "missing")):
        stage = stage_key(batch, 1)
        name = f"b{batch}-q000000"
        written = write_index(index, direct, f"{stage}/eventstore", name, 3600)
        names = [f"bucket={b}/{name}.arrow" for b in written]
        _write_read_marker(direct, stage, "t0", [], {"queries/p/q.jsonl": [1, "e", None]}, 6, 0, names)
        if how == "lease":
            publish_files(via, "t", batch, 1, index=names)
        elif how == "lease start":
            markers_listed[0] = 0
            publish_files(via, "t", batch, 1, indexed=6)
            assert markers_listed[0] >= 2, markers_listed
            markers_listed[0] = -1
        else:
            direct.delete(f"{stage}/eventstore/{names[0]}")
            with pytest.raises(IndexMissingError, match=r"an index file of batch 3 of 't' .named by its task. is"):
                publish_files(via, "t", batch, 1, index=names)
            continue
        moved = sorted(e.key for e in direct.listing("_state/eventstore"))
        assert [k for k in moved if f"/{name}." in k] == sorted(f"_state/eventstore/{n}" for n in names), how
        assert not list(direct.listing(stage)), how  # the stage removed once its files are in place
    assert proxy.dropped


def test_a_batch_reads_its_retry_set_whole_or_not_at_all(
    s3_server: storage_server.Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clicks waiting for their query sit in the last committed batch's retry set, one file per task that had
    some; the next batch lists and reads it. A file the listing missed (as the adds' listing missed one under a
    store SIGKILLed again and again) would have its clicks never looked at again, no outcome, no record. Told how many
    the batch's tasks wrote (its committed "retried"), the set is listed again until it holds them, else the
    batch fails in one line."""
    import pyarrow.parquet as pq

    from photon.joiner.batch import BatchRunner, RetrySetShortError
    from photon.joiner.common import JoinSettings
    from photon.registry.clock import ServerClock
    from tests.integration.drop_proxy import DropProxy

    monkeypatch.setenv("PHOTON_STORAGE_RETRY_S", "1")
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    direct = S3Store(f"s3://{bucket}/out/t")
    for part, n in (("p0", 3), ("p1", 2)):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"due_us": pa.array([0] * n, pa.int64())}), sink)
        direct.put(f"_state/retries/b0000000001-e1/{part}.parquet", sink.getvalue().to_pybytes())
    listed = lambda method, path, h: method == "GET" and "retries" in urllib.parse.unquote(path)  # noqa: E731
    for drops in (1, 10_000):
        proxy = DropProxy(port, listed, drops=drops, empty=True)
        via = S3Store(direct.url, {"aws_endpoint_url": f"http://127.0.0.1:{proxy.port}"})
        runner = BatchRunner(
            dc="dc-a", pipeline="t", logs=via, root=via, servers={}, spark=None, settings=JoinSettings(),
            clock=ServerClock.assumed(), state=None, discovery=None, parallelism=1,  # type: ignore[arg-type]
        )  # fmt: skip
        runner.retry_key, runner.retry_rows = "retries/b0000000001-e1", 5
        if drops == 1:
            assert runner.retry_counts() == (5, 5)
            assert [e.key.rpartition("/")[2] for e in runner.retry_files()] == ["p0.parquet", "p1.parquet"]
        else:
            with pytest.raises(RetrySetShortError, match="the retry set lists 0 clicks of the 5 its batch's tasks"):
                runner.retry_files()
        assert proxy.dropped, drops


def test_publishers_and_listers_ride_a_store_sigkilled_again_and_again(
    s3_server: storage_server.Server, bucket: str
) -> None:
    """Found by SIGKILLing the S3 server under 3 publishers (3-5 failures in 40 kills): a Delta commit whose connection
    was reset as the server died failed the publish (no client retries a conditional put it sent), and so did the
    stage's bulk delete (a POST), and, under listers, a listing whose answer broke off. The server is killed 24 times
    on a seeded schedule while 3 threads publish batches (append_rows: stage, commit under the batch's txn, remove the
    stage) and one lists: no call fails, and each table holds every batch once. (append_rows passes on what it staged:
    with the stage listed instead, 2 full runs of 3 failed here, a SeaweedFS 4.48 SIGKILLed again and again keeping an
    acknowledged adds record out of its folder's listing, HEAD finding it, for as long as nothing else was put there;
    a stage that lists short is the test above.)"""
    import random
    import threading

    from deltalake import DeltaTable

    from photon.logs.schemas import QUARANTINE, QUARANTINE_SCHEMA
    from photon.logs.tables import append_rows

    failed: list[str] = []
    stop = threading.Event()
    published = [0, 0, 0]

    def publish(p: int) -> None:
        store = open_store(f"s3://{bucket}/out/p{p}")
        while not stop.is_set():
            b = published[p] + 1
            rows = {
                "pipeline": [f"p{p}"] * 3, "kind": ["clicks"] * 3, "file": ["f"] * 3, "line": [0, 1, 2],
                "raw": [b"x"] * 3, "raw_bytes": [1] * 3, "reason": ["r"] * 3, "decided_at_us": [b] * 3,
            }  # fmt: skip
            try:
                append_rows(store, QUARANTINE, pa.table(rows, schema=QUARANTINE_SCHEMA), b)
                published[p] = b
            except StorageError as exc:
                failed.append(f"publish p{p} batch {b}: {exc}")
                return

    def list_out() -> None:
        store = open_store(f"s3://{bucket}/out")
        while not stop.is_set():
            try:
                list(store.listing())
            except StorageError as exc:
                failed.append(f"listing: {exc}")
                return

    threads = [threading.Thread(target=publish, args=(p,)) for p in (0, 1, 2)]
    threads += [threading.Thread(target=list_out)]
    for t in threads:
        t.start()
    rng = random.Random(20261207)
    try:
        for _ in range(24):
            time.sleep(rng.uniform(0.2, 1.0))
            storage_server.stop(s3_server.folder, hard=True)
            time.sleep(rng.uniform(0.0, 1.0))
            storage_server.start(s3_server.folder)
            assert not failed, failed
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        storage_server.start(s3_server.folder)
    assert not failed, failed
    for p in (0, 1, 2):
        store = open_store(f"s3://{bucket}/out/p{p}")
        uri, options = store.delta_location(QUARANTINE)
        table = DeltaTable(uri, storage_options=options).to_pyarrow_table()
        batches = table["decided_at_us"].to_pylist()
        want = sorted(b for b in range(1, published[p] + 1) for _ in range(3))
        assert sorted(batches) == want, (p, _log_of(store, QUARANTINE, set(want) ^ set(batches)))
        assert published[p] > 5, published


def _log_of(store: Store, kind: str, batches: set[int]) -> dict[str, Any]:
    """What a table's Delta log says of ``batches`` (the commits naming them, by txn version or data file), its
    checkpoints, and what is left staged: for a failure's message (a batch published once in CI was missing from
    the table, and the table was gone with the test)."""
    log: dict[str, Any] = {"checkpoints": [], "commits": {}, "versions": 0, "gaps": [], "staged": []}
    seen: list[int] = []
    for e in store.listing(f"{kind}/_delta_log"):
        name = e.key.rpartition("/")[2]
        if not name.endswith(".json"):
            log["checkpoints"].append(name)
            continue
        log["versions"] += 1
        if name.removesuffix(".json").isdigit():
            seen.append(int(name.removesuffix(".json")))
        for line in store.get(e.key).decode().splitlines():
            action = json.loads(line)
            txn = action.get("txn", {}).get("version")
            path = action.get("add", {}).get("path", "")
            named = {b for b in batches if txn == b or f"b{b:010d}-" in path}
            if named:
                log["commits"].setdefault(name, []).append(path or {"txn": txn})
    log["gaps"] = sorted(set(range(max(seen, default=-1) + 1)) - set(seen))  # versions whose commit is gone
    log["staged"] = [e.key for e in store.listing("_staging")][:20]
    return log


def test_a_port_taken_between_its_choice_and_the_servers_bind_is_chosen_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a full test run: a restart's metrics port, free when chosen, was taken before weed bound it (weed:
    "bind: address already in use", and exits): the start failed. A port held by someone else at the start is now
    chosen again, and ports are chosen outside the range the kernel hands out for outgoing connections."""
    real = storage_server.free_ports
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    calls = []

    def first_one_taken(n: int) -> list[int]:
        ports = real(n)
        calls.append(ports)
        return [taken.getsockname()[1], *ports[1:]] if len(calls) == 1 else ports

    monkeypatch.setattr(storage_server, "free_ports", first_one_taken)
    folder = tmp_path / "s3"
    try:
        server = storage_server.start(folder)
        assert len(calls) == 2 and taken.getsockname()[1] not in server.ports.values(), calls
        said = (folder / "server.log").read_text()
        assert any(m in said for m in storage_server.PORT_TAKEN), said[-2000:]  # weed's refusal, then the retry
    finally:
        storage_server.stop(folder, hard=True)
        taken.close()
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(p < low for p in real(20)), "chosen among the ports handed out for outgoing connections"

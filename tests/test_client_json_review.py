"""Hostile review of fd24c61 + 625aaa9: cmroot.client now encodes request bodies with
msgspec (falling back to json.dumps on UnicodeEncodeError) and decodes answers with msgspec
(falling back to json.loads on msgspec.DecodeError). Before, both ways were the stdlib json.

Reference for "before": `json.dumps(body, separators=(",", ":")).encode()` for what was
sent, and `json.loads(data)` (JSONDecodeError -> CmrootError, anything else raw) for what
was read. Everything runs against a fake daemon on loopback.

test_break_*: a real difference (or an invariant violation) that failed on 625aaa9. All
are fixed since: requests are written by the stdlib again (msgspec sent NaN/Infinity as
null, so a lease of inf read as "none given", and bytes as base64), and an answer msgspec
cannot read (a raw surrogate, a UnicodeDecodeError, nesting past the recursion limit) goes
to the stdlib, whose failure is a CmrootError.
test_held_*:  attacks that found nothing."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import http.server
import json
import math
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from cmroot.client import Client  # noqa: E402
from cmroot.exceptions import CmrootError  # noqa: E402
from tests.test_client import _Fake, _send  # noqa: E402

pytestmark = pytest.mark.timeout(120)


# -- helpers -----------------------------------------------------------------------------
def _old_payload(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _canon(raw: bytes) -> str:
    """What the bytes mean as JSON (NaN stays NaN, null stays null; escapes normalised)."""
    return json.dumps(json.loads(raw), separators=(",", ":"))


class _Capture:
    """A loopback fake daemon that keeps every request body and answers `answer`."""

    def __init__(self, answer: bytes = b'{"id":1,"expires":1.0}') -> None:
        self.bodies: list[tuple[str, str, bytes]] = []
        self.answer = answer
        cap = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                cap.bodies.append((self.command, self.path, self.rfile.read(n)))
                _send(self, cap.answer)

            do_GET = do_POST = do_DELETE = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def cap() -> Any:
    c = _Capture()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def answering() -> Any:
    """A fake whose answer the test sets: state["body"]."""
    state: dict[str, bytes] = {"body": b"{}"}
    fake = _Fake(lambda h: _send(h, state["body"]))
    try:
        yield fake, state
    finally:
        fake.close()


def _old_read(data: bytes) -> Any:
    """What the client's _json did before fd24c61 with an answer body."""
    try:
        out = json.loads(data)
    except json.JSONDecodeError:
        return CmrootError
    if not isinstance(out, dict):
        return CmrootError
    return out


def _read_now(answering: Any, data: bytes) -> Any:
    fake, state = answering
    state["body"] = data
    c = Client(fake.url, timeout=10)
    try:
        return c.holds()  # GET /v1/holds: the answer comes back as read
    finally:
        c.close()


# ========================================================================================
# BREAKS: requests
# ========================================================================================
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_break_renew_nonfinite_lease_becomes_null(cap: _Capture, bad: float) -> None:
    # DIFFERS: msgspec writes nan/inf as `null`; json.dumps wrote NaN/Infinity. The daemon
    # (schemas.RenewBody, msgspec, `lease: Lease | None = None`) refused NaN/Infinity as
    # malformed JSON (400), but takes `null` as "no lease given": renew(txid, lease=inf)
    # now SUCCEEDS silently with the default lease instead of failing. Same for
    # prepare(lease=nan) (lease dropped -> default) and any NaN inside add_event's
    # tableObj/partitions (stored as null). MATTERS: medium - a caller's bad value turns
    # into a different, accepted request (a lease far shorter than asked).
    c = Client(cap.url, timeout=10)
    try:
        c.renew("tx1", lease=bad)
    except (CmrootError, KeyError, TypeError, ValueError):
        pass
    sent = cap.bodies[-1][2]
    assert _canon(sent) == _canon(_old_payload({"lease": bad})), sent


def test_break_add_hold_nan_until_becomes_null(cap: _Capture) -> None:
    # DIFFERS: "until": NaN -> "until": null. The daemon refuses both (400) but with a
    # different message ("Expected float, got null" instead of malformed JSON). MATTERS: low.
    c = Client(cap.url, timeout=10)
    c.add_hold("db", None, math.nan, "why")
    assert _canon(cap.bodies[-1][2]) == _canon(
        _old_payload({"db": "db", "table": None, "until": math.nan, "reason": "why"})
    )


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda c: c.recycle([b"/wh/x"], op="DELETE"), id="recycle-bytes-path"),
        pytest.param(
            lambda c: c.resolve([{"path": b"/wh/x", "checksum": "0" * 32}]),
            id="resolve-bytes-path",
        ),
        pytest.param(
            lambda c: c.add_event("CREATE_TABLE", db="d", table="t", files=[{"path": b"/wh/f"}]),
            id="add_event-bytes-path",
        ),
        pytest.param(lambda c: c.recycle([bytearray(b"/wh/x")], op="DELETE"), id="bytearray"),
        pytest.param(
            lambda c: c.add_event("CREATE_TABLE", db="d", table="t", partitions={"p"}),
            id="set",
        ),
        pytest.param(
            lambda c: c.add_event(
                "CREATE_TABLE", db="d", table="t", tableObj={"t": datetime.datetime(2020, 1, 1)}
            ),
            id="datetime",
        ),
        pytest.param(
            lambda c: c.add_event(
                "CREATE_TABLE", db="d", table="t", tableObj={"x": decimal.Decimal("1.1")}
            ),
            id="Decimal",
        ),
        pytest.param(
            lambda c: c.add_event("CREATE_TABLE", db="d", table="t", tableObj={"u": uuid.uuid4()}),
            id="UUID",
        ),
        pytest.param(
            lambda c: c.add_event(
                "CREATE_TABLE", db="d", table="t",
                tableObj=dataclasses.make_dataclass("D", ["a"])(1),
            ),
            id="dataclass",
        ),
    ],
)
def test_break_non_json_input_no_longer_a_type_error(cap: _Capture, call: Callable) -> None:
    # DIFFERS: json.dumps raised TypeError ("Object of type bytes is not JSON serializable")
    # before anything was sent. msgspec encodes bytes as BASE64 ("/wh/x" -> "L3doL3g="),
    # sets as lists, datetime/UUID/Decimal as strings, dataclasses as objects, and SENDS it.
    # MATTERS: medium for bytes - a path given as bytes (os.fsencode, a listdir(b".")) goes
    # to the daemon as a meaningless base64 string: refused as a relative path at best, and
    # in tableObj it is silently stored mangled. For the others: a programming error that
    # used to be caught locally now reaches (and may be stored by) the daemon.
    c = Client(cap.url, timeout=10)
    raised: BaseException | None = None
    try:
        call(c)
    except Exception as e:  # the fake's answer lacks fields: KeyError
        raised = e
    sent = [b for _, _, b in cap.bodies]
    assert isinstance(raised, TypeError) and sent == [], f"sent {sent!r}, raised {raised!r}"


@pytest.mark.parametrize("key", [True, False, None])
def test_break_bool_and_none_dict_keys_now_a_type_error(cap: _Capture, key: Any) -> None:
    # DIFFERS: json.dumps wrote {True: "1"} as {"true":"1"} and {None: ...} as {"null":...};
    # msgspec raises TypeError "Only dicts with str-like or number-like keys are supported".
    # MATTERS: low (a partition spec keyed by a bool/None is odd), but an input that was
    # sent before now fails in the client.
    c = Client(cap.url, timeout=10)
    c.add_event("ADD_PARTITION", db="d", table="t", partitions=[{key: "1"}])
    assert _canon(cap.bodies[-1][2]) == _canon(
        _old_payload({"eventType": "ADD_PARTITION", "db": "d", "table": "t",
                      "partitions": [{key: "1"}]})
    )


def test_break_circular_input_error_changed(cap: _Capture) -> None:
    # DIFFERS: a self-referencing body: json.dumps raised ValueError("Circular reference
    # detected"); msgspec raises RecursionError after recursing ~1000 deep. MATTERS: low.
    loop: list[Any] = []
    loop.append(loop)
    c = Client(cap.url, timeout=10)
    with pytest.raises(ValueError, match="Circular"):
        c.add_event("CREATE_TABLE", db="d", table="t", tableObj={"x": loop})


# ========================================================================================
# BREAKS: answers
# ========================================================================================
def test_break_raw_utf8_encoded_surrogate_in_answer_is_a_raw_exception(answering: Any) -> None:
    # DIFFERS: a surrogate written raw in UTF-8 ("\xed\xa0\x80", what a daemon writing with
    # ensure_ascii=False + surrogatepass emits) - json.loads(bytes) decodes with
    # 'surrogatepass' and read {"holds": ["\ud800"]}. msgspec raises UnicodeDecodeError,
    # which is NOT a msgspec.DecodeError, so the fallback never runs: a raw
    # UnicodeDecodeError traceback escapes Client.holds(). MATTERS: low in practice (the
    # daemon writes through msgspec, which refuses surrogates), but it is both a regression
    # and a raw exception from a bad/odd answer.
    data = b'{"holds":["\xed\xa0\x80"]}'
    assert _old_read(data) == {"holds": ["\ud800"]}
    assert _read_now(answering, data) == {"holds": ["\ud800"]}


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b'{"a":"\xff"}', id="invalid-utf8-inside-a-string"),
        pytest.param(b'{"a":"\xc0\x80"}', id="overlong-utf8-inside-a-string"),
        pytest.param(b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}", id="nested-5000"),
    ],
)
def test_break_preexisting_bad_answer_is_a_raw_exception(answering: Any, data: bytes) -> None:
    # NOT A REGRESSION (json.loads raised the same raw UnicodeDecodeError / RecursionError
    # before fd24c61), but it violates "a bad answer gives a CmrootError, never a raw
    # exception": msgspec raises UnicodeDecodeError for bad UTF-8 inside a string and
    # RecursionError past ~1000 levels, neither a msgspec.DecodeError, and the stdlib
    # fallback catches only ValueError (RecursionError is not one). MATTERS: low-medium -
    # a broken proxy or a hostile endpoint gets a traceback out of every CLI command.
    with pytest.raises(CmrootError, match="bad answer"):
        _read_now(answering, data)


# ========================================================================================
# HELD: answers read as before
# ========================================================================================
@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"   \n", id="whitespace"),
        pytest.param(b"[1,2]", id="array"),
        pytest.param(b'"x"', id="string"),
        pytest.param(b"null", id="null"),
        pytest.param(b"123", id="number"),
        pytest.param(b'{"a":1', id="truncated"),
        pytest.param(b'{"a":1}x', id="trailing"),
        pytest.param(b'{"a":1}\x00', id="trailing-nul"),
        pytest.param(b'{"a":"\x01"}', id="raw-control-char"),
        pytest.param(b"<html>502 Bad Gateway</html>", id="html"),
        pytest.param(b'{"a":NaN}', id="NaN"),
        pytest.param(b'{"a":Infinity,"b":-Infinity}', id="Infinity"),
        pytest.param(b'{"a":1,"a":2}', id="duplicate-keys"),
        pytest.param(b'{"a":%d}' % 2**70, id="int-2**70"),
        pytest.param(b'{"a":-%d}' % 2**70, id="int--2**70"),
        pytest.param(b'{"a":%d}' % 2**64, id="int-2**64"),
        pytest.param(b'{"a":1e400,"b":-1e400,"c":1e-400}', id="float-overflow"),
        pytest.param(b'{"a":"\\ud800","b":"\\udfff x"}', id="escaped-lone-surrogate"),
        pytest.param(b'{"\\ud800":1}', id="escaped-lone-surrogate-key"),
        pytest.param(b'{"a":"\\ud83d\\ude00"}', id="escaped-pair"),
        pytest.param(b"\xef\xbb\xbf{\"a\":1}", id="utf8-bom"),
        pytest.param('{"a":"é"}'.encode("utf-16"), id="utf-16"),
        pytest.param('{"a":1}'.encode("utf-32-le"), id="utf-32-le"),
        pytest.param(b'{"a":' + b"[" * 900 + b"]" * 900 + b"}", id="nested-900"),
        pytest.param(b'{"a":-0.0,"b":1E2,"c":0.1000000000000000055511151231257827}', id="floats"),
    ],
)
def test_held_answer_read_as_before(answering: Any, data: bytes) -> None:
    old = _old_read(data)
    if old is CmrootError:
        with pytest.raises(CmrootError, match="bad answer"):
            _read_now(answering, data)
    else:
        now = _read_now(answering, data)
        assert json.dumps(now) == json.dumps(old)  # NaN-safe, type-exact for int/float
        assert [type(v) for v in now.values()] == [type(v) for v in old.values()]


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\xff\xfe\xfd", id="non-utf8"),
        pytest.param(b'{"a":' + b"1" * 5000 + b"}", id="int-past-4300-digits"),
    ],
)
def test_held_and_better_bad_answer_is_cmroot_error(answering: Any, data: bytes) -> None:
    # Before: raw UnicodeDecodeError / ValueError (not JSONDecodeError). Now a CmrootError.
    with pytest.raises(CmrootError, match="bad answer"):
        _read_now(answering, data)


def test_held_typed_calls_on_odd_answers(answering: Any) -> None:
    fake, state = answering
    c = Client(fake.url, timeout=10)
    state["body"] = b'{"id":%d}' % 2**70
    assert c.current_event() == 2**70  # exact, not a float
    state["body"] = b'{"id":1,"id":7}'
    assert c.current_event() == 7
    state["body"] = b"[]"
    with pytest.raises(CmrootError):
        c.current_event()
    state["body"] = b'{"files":[{"path":"\\udc80","checksum":"0","status":"missing"}]}'
    assert c.resolve([{"path": "/x", "checksum": "0" * 32}]).files[0].path == "\udc80"
    state["body"] = b"nope"
    assert c.healthy() is False


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(), kids, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.text(), json_values, max_size=4), st.booleans())
def test_held_hypothesis_answers_decode_as_before(
    answering: Any, value: dict[str, Any], ascii_only: bool
) -> None:
    try:
        data = json.dumps(value, ensure_ascii=ascii_only).encode()
    except UnicodeEncodeError:
        return  # a lone surrogate with ensure_ascii=False: not writable as UTF-8
    from cmroot import client as client_mod

    try:
        now = client_mod._DECODER.decode(data)
    except client_mod.msgspec.DecodeError:
        now = json.loads(data)
    assert json.dumps(now) == json.dumps(json.loads(data))


# ========================================================================================
# HELD: requests sent as before
# ========================================================================================
@pytest.mark.parametrize(
    "call, expect",
    [
        pytest.param(
            lambda c: c.resolve([{"path": "/wh/\udcff", "checksum": "0" * 32}]),
            {"files": [{"path": "/wh/\udcff", "checksum": "0" * 32}]},
            id="resolve-lone-surrogate",
        ),
        pytest.param(
            lambda c: c.recycle(["/wh/\ud800x", "/wh/é"], op="DELETE"),
            {"paths": ["/wh/\ud800x", "/wh/é"], "op": "DELETE"},
            id="recycle-lone-surrogate",
        ),
        pytest.param(
            lambda c: c.add_event("CREATE_TABLE", db="d", table="t",
                                  files=[{"path": "/wh/\udc80"}], tableObj={"n": math.nan}),
            {"eventType": "CREATE_TABLE", "db": "d", "table": "t",
             "files": [{"path": "/wh/\udc80"}], "tableObj": {"n": math.nan}},
            id="add_event-surrogate-plus-nan-falls-back-whole",
        ),
        pytest.param(
            lambda c: c.add_event("CREATE_TABLE", db="d", table="t",
                                  partitions=({"p": "1"}, {"p": "2"}),
                                  tableObj={1: "a", 2.5: "b", "big": 2**70, "neg": -(2**70)}),
            {"eventType": "CREATE_TABLE", "db": "d", "table": "t",
             "partitions": [{"p": "1"}, {"p": "2"}],
             "tableObj": {"1": "a", "2.5": "b", "big": 2**70, "neg": -(2**70)}},
            id="tuples-int-float-keys-huge-ints",
        ),
        pytest.param(
            lambda c: c.add_hold("d", "t", 1e16, "ünïcode \u2028 \x00"),
            {"db": "d", "table": "t", "until": 1e16, "reason": "ünïcode \u2028 \x00"},
            id="add_hold-nonascii-control",
        ),
        pytest.param(lambda c: c.renew("tx", 30.5), {"lease": 30.5}, id="renew"),
    ],
)
def test_held_request_means_the_same(cap: _Capture, call: Callable, expect: Any) -> None:
    c = Client(cap.url, timeout=10)
    try:
        call(c)
    except (KeyError, TypeError, CmrootError):
        pass  # the fake's {} answer lacks fields; only the request matters here
    assert cap.bodies, "nothing sent"
    assert _canon(cap.bodies[-1][2]) == _canon(_old_payload(expect))


def test_held_lone_surrogate_in_key_falls_back(cap: _Capture) -> None:
    c = Client(cap.url, timeout=10)
    c.add_event("ADD_PARTITION", db="d", table="t", partitions=[{"\udc80": "1"}])
    assert b"\\udc80" in cap.bodies[-1][2]


def test_held_surrogate_with_bytes_still_type_error(cap: _Capture) -> None:
    # msgspec fails on the surrogate first; the json.dumps fallback then refuses bytes.
    c = Client(cap.url, timeout=10)
    with pytest.raises(TypeError):
        c.recycle(["/wh/\udc80", b"/wh/y"], op="DELETE")
    assert cap.bodies == []

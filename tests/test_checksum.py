"""Checksums: xxHash3-128 as 32 lowercase hex chars, the same through every code path
(bytes, local file, stream, fsspec), and a strict validator for request input."""

from __future__ import annotations

import io
import re

import fsspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from cmroot import checksum as cks
from cmroot.exceptions import BadRequest

CHUNK = cks.CHUNK
HEX32 = re.compile(r"[0-9a-f]{32}")


def test_known_vectors() -> None:
    # Reference XXH3-128 digests: pins the algorithm, the width and the spelling.
    assert cks.of_bytes(b"") == "99aa06d3014798d86001c324468d497f"
    assert cks.of_bytes(b"abc") == "06b05ab6733a618578af5f94892f3950"
    assert cks.of_bytes(b"abc") == xxhash.xxh3_128(b"abc").hexdigest()


@pytest.mark.parametrize("size", [0, 1, 4095, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17])
def test_every_path_agrees_around_chunk_boundaries(tmp_path, size: int) -> None:
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    p = tmp_path / "f"
    p.write_bytes(data)
    want = xxhash.xxh3_128_hexdigest(data)
    assert cks.of_bytes(data) == want
    assert cks.of_local_file(str(p)) == want
    assert cks.of_stream(io.BytesIO(data)) == want
    assert cks.of_file(None, str(p)) == want
    assert cks.of_file(fsspec.filesystem("file"), str(p)) == want


def test_of_stream_hashes_from_current_position_and_without_readinto() -> None:
    data = b"x" * 10 + b"payload" * 1000

    class ReadOnly:
        """A stream with read() but no readinto()."""

        def __init__(self, b: bytes) -> None:
            self._f = io.BytesIO(b)

        def read(self, n: int = -1) -> bytes:
            return self._f.read(n)

    assert cks.of_stream(ReadOnly(data)) == cks.of_bytes(data)
    f = io.BytesIO(data)
    f.seek(10)
    assert cks.of_stream(f) == cks.of_bytes(data[10:])


def test_of_file_on_a_non_local_fsspec_filesystem() -> None:
    fs = fsspec.filesystem("memory")
    data = b"remote bytes" * 100_000
    with fs.open("/cmroot-test/remote.bin", "wb") as f:
        f.write(data)
    try:
        assert cks.of_file(fs, "/cmroot-test/remote.bin") == cks.of_bytes(data)
    finally:
        fs.rm("/cmroot-test", recursive=True)


def test_of_local_file_missing_raises_oserror(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        cks.of_local_file(str(tmp_path / "nope"))


@pytest.mark.parametrize(
    "good", ["0" * 32, "f" * 32, "0123456789abcdef0123456789abcdef", cks.of_bytes(b"x")]
)
def test_validate_accepts_32_lowercase_hex(good: str) -> None:
    assert cks.validate(good) == good


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "0" * 31,
        "0" * 33,
        "A" * 32,
        "0123456789ABCDEF0123456789abcdef",
        "g" * 32,
        " " + "0" * 31,
        "0" * 32 + "\n",
        "0" * 31 + "\0",
        "0x" + "0" * 30,
        None,
        0,
        12345,
        b"0" * 32,
        ["0" * 32],
        {"checksum": "0" * 32},
        "\u0660" * 32,  # Arabic-Indic digits
    ],
)
def test_validate_refuses_anything_else(bad: object) -> None:
    with pytest.raises(BadRequest) as ei:
        cks.validate(bad)
    assert ei.value.status == 400
    assert "checksum" in str(ei.value)


def test_many_keeps_order_and_reports_progress(tmp_path) -> None:
    paths = []
    for i in range(40):
        p = tmp_path / f"f{i}"
        p.write_bytes(str(i).encode() * (i + 1))
        paths.append(str(p))
    seen: list[int] = []
    out = list(cks.many(cks.of_local_file, paths, workers=4, progress=seen.append))
    assert [p for p, _ in out] == paths
    assert all(c == cks.of_local_file(p) for p, c in out)
    assert seen == list(range(1, 41))
    assert cks.default_workers() >= 1


def test_many_propagates_a_failure(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        list(cks.many(cks.of_local_file, [str(tmp_path / "missing")], workers=2))


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=5000))
def test_round_trip_over_arbitrary_bytes(tmp_path_factory, data: bytes) -> None:
    c = cks.of_bytes(data)
    assert HEX32.fullmatch(c)
    assert cks.validate(c) == c
    assert cks.of_stream(io.BytesIO(data)) == c
    p = tmp_path_factory.mktemp("h") / "f"
    p.write_bytes(data)
    assert cks.of_local_file(str(p)) == c
    # one flipped byte is another checksum
    if data:
        flipped = bytes([data[0] ^ 1]) + data[1:]
        assert cks.of_bytes(flipped) != c


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=40), st.binary(max_size=40), st.integers(), st.none()))
def test_validate_never_raises_anything_but_bad_request(value: object) -> None:
    try:
        assert cks.validate(value) == value
        assert isinstance(value, str) and HEX32.fullmatch(value)
    except BadRequest:
        assert not (isinstance(value, str) and HEX32.fullmatch(value))

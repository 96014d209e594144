"""The root attributes of an HDF5 trace (``format``, ``format_version``, ``meta``), read by a small
parser of our own rather than by HDF5.

Why: HDF5 keeps variable-length strings (``format``, ``meta``) in a global heap collection, which
has no checksum, and HDF5 2.0 loops forever on a collection whose free-space entry says size 0
(tests/data/crashers/hang.h5). The loop holds the GIL: nothing in the process can stop it. This
parser reads only the superblock, the root object header and the heap objects the attributes point
at; every address and length is checked against the file and every loop advances, so it ends. HDF5
is never asked for these attributes in our process, so it never parses a global heap (the trace's
datasets hold fixed-size types only, which readers check before reading).

Layouts the parser does not know (attributes in dense storage, shared messages, a newer superblock,
a root object header of more than MAX_HEADER bytes) are read by h5py in a child process under a time
limit. On the files h5py writes, the values read are the ones h5py reads (tests/test_trace_checks.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tracediff.errors import TraceError
from tracediff.trace.checks import MAX_META_BYTES

SIGNATURE = b"\x89HDF\r\n\x1a\n"
WANTED = ("format", "format_version", "meta", "meta_crc32")  # meta_crc32: format version 3 on
MAX_CHUNKS = 64  # object header chunks followed (ours have one)
MAX_BLOCK = 1 << 20  # bytes of one header chunk or superblock field block
MAX_HEADER = 1 << 20  # bytes of all the root header's chunks together (ours: under 1 KiB)
MAX_RANK = 32  # dims of an HDF5 dataspace
CLASSES = ("an integer", "a floating-point number", "a time", "a string", "a bitfield", "an opaque value",
           "a compound value", "a reference", "an enum (a bool, say)", "a variable-length sequence",
           "an array value")
CHILD_TIMEOUT = 20.0  # seconds for h5py to read the attributes of a layout the parser does not know
ATTRIBUTE, CONTINUATION, ATTRIBUTE_INFO = 0x0C, 0x10, 0x15


class Unsupported(Exception):
    """A valid layout this parser does not read (h5py reads it, in a child process)."""


class Malformed(Exception):
    """A structure that cannot be right."""


class _File:
    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size

    def read(self, at: int, n: int, what: str) -> bytes:
        if at < 0 or n < 0 or at + n > self.size:
            raise Malformed(f"{what} at byte {at} ({n} bytes) lies past the end of the file ({self.size})")
        if n > MAX_BLOCK + MAX_META_BYTES:
            raise Malformed(f"{what} at byte {at} claims {n} bytes")
        data = os.pread(self.fd, n, at)
        if len(data) != n:
            raise Malformed(f"{what} at byte {at}: the file ends early")
        return data


class _Cursor:
    """Little-endian fields of one block; reading past its end is Malformed, never garbage."""

    def __init__(self, data: bytes, offsets: int = 8, lengths: int = 8, what: str = "a header") -> None:
        self.data, self.pos, self.offsets, self.lengths, self.what = data, 0, offsets, lengths, what

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise Malformed(f"{self.what} runs past its block")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "little")

    def address(self) -> int:
        return self.uint(self.offsets)

    def length(self) -> int:
        return self.uint(self.lengths)


def _undefined(address: int, width: int) -> bool:
    return address == (1 << (8 * width)) - 1


def _superblock(f: _File) -> tuple[int, int, int, int]:
    """(base address, size of offsets, size of lengths, root object header address)."""
    at = 0
    while f.read(at, 8, "the HDF5 signature") != SIGNATURE:
        at = 512 if at == 0 else at * 2
        if at + 8 > f.size:
            raise Malformed("no HDF5 superblock")
    version = f.read(at + 8, 1, "the superblock")[0]
    if version in (0, 1):
        head = f.read(at, 24, "the superblock")
        offsets, lengths = head[13], head[14]
        start = at + (28 if version == 1 else 24)
    elif version in (2, 3):
        head = f.read(at, 12, "the superblock")
        offsets, lengths = head[9], head[10]
        start = at + 12
    else:
        raise Unsupported(f"superblock version {version}")
    if offsets not in (2, 4, 8) or lengths not in (2, 4, 8):
        raise Malformed(f"superblock sizes of offsets {offsets} and lengths {lengths}")
    fields = _Cursor(f.read(start, 6 * offsets, "the superblock"), offsets, lengths, "the superblock")
    base = fields.address()
    if version in (0, 1):
        for _ in range(4):  # free-space, end-of-file and driver addresses, the root entry's name offset
            fields.address()
    else:
        for _ in range(2):  # superblock extension and end-of-file addresses
            fields.address()
    return base, offsets, lengths, base + fields.address()


def _messages(f: _File, base: int, address: int, offsets: int,
              lengths: int) -> Iterator[tuple[int, int, bytes]]:
    """(type, flags, body) of every message of the object header at ``address``, its
    continuation chunks included (at most MAX_CHUNKS)."""
    v2 = f.read(address, 4, "the root object header") == b"OHDR"
    if v2:
        head = f.read(address, 6, "the root object header")
        if head[4] != 2:
            raise Unsupported(f"object header version {head[4]}")
        flags = head[5]
        at = address + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
        width = 1 << (flags & 3)
        size = int.from_bytes(f.read(at, width, "the root object header"), "little")
        chunks = [(at + width, size)]
        header = 6 if flags & 0x04 else 4
    else:
        prefix = _Cursor(f.read(address, 16, "the root object header"), what="the root object header")
        if prefix.uint(1) != 1:
            raise Unsupported("an object header that is neither version 1 nor 2")
        prefix.take(7)
        chunks, header = [(address + 16, prefix.uint(4))], 8
    total = 0
    for k, (at, size) in enumerate(chunks):
        if k == MAX_CHUNKS:
            raise Malformed(f"more than {MAX_CHUNKS} object header chunks")
        if size > MAX_BLOCK:
            raise Malformed(f"an object header chunk of {size} bytes")
        total += size
        if total > MAX_HEADER:  # each byte costs Python work: 64 chunks of 1 MiB took 20 s
            raise Unsupported(f"a root object header of more than {MAX_HEADER} bytes")
        data = f.read(at, size, "an object header chunk")
        if v2 and k > 0:
            if data[:4] != b"OCHK" or len(data) < 8:
                raise Malformed("an object header continuation without its signature")
            data = data[4:-4]
        pos = 0
        while pos + header <= len(data):
            fields = _Cursor(data[pos : pos + header], what="an object header message")
            kind = fields.uint(1 if v2 else 2)
            length, mflags = fields.uint(2), fields.uint(1)
            body = data[pos + header : pos + header + length]
            if len(body) != length:
                raise Malformed("an object header message runs past its chunk")
            pos += header + length
            if kind == CONTINUATION:
                cursor = _Cursor(body, offsets, lengths, "a continuation message")
                chunks.append((base + cursor.address(), cursor.length()))
            yield kind, mflags, body


def _pad(n: int, padded: bool) -> int:
    return (n + 7) & ~7 if padded else n


def _attribute(body: bytes, offsets: int, lengths: int) -> tuple[str, bytes, bytes, bytes]:
    """(name, datatype, dataspace, data) of an attribute message."""
    c = _Cursor(body, offsets, lengths, "an attribute message")
    version = c.uint(1)
    if version not in (1, 2, 3):
        raise Malformed(f"attribute message version {version}")
    flags = c.uint(1)
    if version > 1 and flags & 3:
        raise Unsupported("an attribute with a shared datatype or dataspace")
    name_size, type_size, space_size = c.uint(2), c.uint(2), c.uint(2)
    if version == 3:
        c.take(1)  # name encoding
    padded = version == 1
    name = c.take(_pad(name_size, padded))[:name_size].split(b"\0", 1)[0]
    datatype = c.take(_pad(type_size, padded))[:type_size]
    dataspace = c.take(_pad(space_size, padded))[:space_size]
    return name.decode("utf-8", "replace"), datatype, dataspace, c.data[c.pos :]


def _space_kind(dataspace: bytes, lengths: int) -> int:
    """0: one value without dims, the only kind h5py reads as a number or bytes; 1: an array (even
    of one element); 2: no value (null)."""
    c = _Cursor(dataspace, lengths=lengths, what="a dataspace")
    version, rank = c.uint(1), c.uint(1)
    c.take(1)
    if version == 1:
        c.take(5)
        kind = 1 if rank else 0
    elif version == 2:
        kind = c.uint(1)
    else:
        raise Malformed(f"dataspace version {version}")
    if kind not in (0, 1, 2) or rank > MAX_RANK:
        raise Malformed(f"a dataspace of kind {kind} and rank {rank}")
    return kind


def _value(f: _File, base: int, datatype: bytes, dataspace: bytes, data: bytes, offsets: int,
           lengths: int) -> object:
    """An int, bytes (a string), or a ``TypeError`` instance saying what else it is."""
    if len(datatype) < 8:
        raise Malformed("a datatype message of less than 8 bytes")
    kind, bits, size = datatype[0] & 0x0F, datatype[1], int.from_bytes(datatype[4:8], "little")
    space = _space_kind(dataspace, lengths)
    if space:
        return TypeError("an array, not a single value" if space == 1 else "an empty (null) value")
    if kind == 0 and size in (1, 2, 4, 8) and len(data) >= size:  # fixed-point
        return int.from_bytes(data[:size], "big" if bits & 1 else "little", signed=bool(bits & 0x08))
    if kind == 3 and len(data) >= size:  # fixed-length string, as h5py reads each padding
        raw, padding = data[:size], bits & 0x0F
        if padding == 0:  # null-terminated
            return raw.split(b"\0", 1)[0]
        return (raw.rstrip(b" ") if padding == 2 else raw).rstrip(b"\0")
    if kind == 9 and bits & 0x0F == 1:  # variable-length string: (length, heap collection, index)
        c = _Cursor(data, offsets, lengths, "a variable-length string")
        n, collection, index = c.uint(4), c.address(), c.uint(4)
        return _heap_object(f, base + collection, index, n, lengths) if n else b""
    return TypeError(CLASSES[kind] if kind < len(CLASSES) else f"an HDF5 value of type class {kind}")


def _heap_object(f: _File, address: int, index: int, n: int, lengths: int) -> bytes:
    """Object ``index`` of the global heap collection at ``address``: its first n bytes."""
    if n > MAX_META_BYTES:
        raise Malformed(f"a string attribute of {n} bytes")
    head = f.read(address, 8 + lengths, "a global heap collection")
    if head[:4] != b"GCOL" or head[4] != 1:
        raise Malformed(f"a string attribute points at byte {address}, where no global heap collection "
                        "starts")
    size = int.from_bytes(head[8:], "little")
    if size < 8 + lengths or size > MAX_META_BYTES + MAX_BLOCK:
        raise Malformed(f"a global heap collection of {size} bytes")
    data = f.read(address, size, "a global heap collection")
    header = 8 + lengths  # index, reference count, reserved, size
    objects: dict[int, bytes] = {}
    pos = 8 + lengths
    while pos + header <= size:  # each step moves on by at least one object header, or ends
        found = int.from_bytes(data[pos : pos + 2], "little")
        length = int.from_bytes(data[pos + 8 : pos + header], "little")
        if found == 0:  # free space, header included: exactly the rest of the collection
            if length != size - pos:
                raise Malformed(f"the global heap collection at byte {address} is corrupt: its free space "
                                f"claims {length} bytes where {size - pos} remain")
            break
        if pos + header + length > size:
            raise Malformed(f"an object of the global heap collection at byte {address} runs past it")
        objects[found] = data[pos + header : pos + header + length]
        pos += header + ((length + 7) & ~7)
    if index not in objects:
        raise Malformed(f"global heap object {index} is not in the collection at byte {address}")
    if n > len(objects[index]):
        raise Malformed(f"a string attribute of {n} bytes in a heap object of {len(objects[index])}")
    return objects[index][:n]


def _parse(path: Path) -> dict[str, object]:
    fd = os.open(path, os.O_RDONLY)
    try:
        f = _File(fd, os.fstat(fd).st_size)
        base, offsets, lengths, root = _superblock(f)
        found: dict[str, tuple[bytes, bytes, bytes]] = {}
        dense = False
        for kind, flags, body in _messages(f, base, root, offsets, lengths):
            if kind == ATTRIBUTE:
                if flags & 0x02:
                    raise Unsupported("a shared attribute message")
                name, datatype, dataspace, data = _attribute(body, offsets, lengths)
                if name in WANTED:
                    found[name] = (datatype, dataspace, data)
            elif kind == ATTRIBUTE_INFO and len(body) >= 2:
                c = _Cursor(body, offsets, lengths, "an attribute info message")
                c.take(1)
                if c.uint(1) & 1:
                    c.take(2)
                dense = not _undefined(c.address(), offsets)
        if dense and len(found) < len(WANTED):
            raise Unsupported("attributes in dense storage")
        return {name: _value(f, base, *parts, offsets, lengths) for name, parts in found.items()}
    finally:
        os.close(fd)


def root_attributes(path: Path) -> dict[str, object]:
    """The wanted root attributes present: int, bytes (strings) or a TypeError saying what else."""
    try:
        return _parse(path)
    except Unsupported:
        return _read_in_child(path)
    except Malformed as exc:
        raise TraceError(path, f"unreadable HDF5 root attributes: {exc}") from None
    except OSError as exc:
        raise TraceError(path, f"cannot read: {exc.strerror or exc}") from None


_CHILD = """
import json, sys
import h5py
try:
    f = h5py.File(sys.argv[1], "r")
except OSError as exc:  # SWMR mode only for what needs it: it retries a bad checksum for minutes
    if "already open for write" not in str(exc):
        raise
    f = h5py.File(sys.argv[1], "r", swmr=True)
out = {}
for key in WANTED:
    if key in f.attrs:
        v = f.attrs[key]
        if isinstance(v, str):
            v = v.encode("utf-8", "surrogateescape")
        integer = getattr(v, "shape", None) == () and str(getattr(v, "dtype", "")).startswith(("int", "uint"))
        out[key] = ({"hex": v.hex()} if isinstance(v, bytes) else {"int": int(v)} if integer
                    else {"other": type(v).__name__})
print(json.dumps(out))
""".replace("WANTED", repr(WANTED))


def _read_in_child(path: Path) -> dict[str, object]:
    """h5py reads the attributes in a child process that may take at most CHILD_TIMEOUT seconds. Its
    answer is its last line of output (a sitecustomize may print before it)."""
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise TraceError(path, f"HDF5 took more than {CHILD_TIMEOUT:.0f} s to read its root attributes "
                               "(a corrupt file)") from None
    except OSError as exc:
        raise TraceError(path, f"cannot start Python ({sys.executable!r}) to read its HDF5 root attributes "
                               f"with h5py: {exc.strerror or exc}") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise TraceError(path, f"unreadable HDF5 root attributes: {lines[-1][:200]}")
    try:
        answer = json.loads((done.stdout.strip().splitlines() or [""])[-1])
    except ValueError:
        raise TraceError(path, "unreadable HDF5 root attributes: h5py's reader gave no answer") from None
    values: dict[str, object] = {}
    for key, value in answer.items():
        values[key] = (bytes.fromhex(value["hex"]) if "hex" in value else value["int"] if "int" in value
                       else TypeError(f"a {value['other']}"))
    return values

#!/usr/bin/env python3
"""Independent reader and verifier for redline shard sets (format version 1).

Written from crates/shard/FORMAT.md alone, without looking at the Rust code, to show
that the specification is complete on its own. Standard library only (Python 3.11).

Usage:
    python3 read_shards.py DIR [DIR ...]

Each DIR is a shard-set directory holding manifest.json. Every rule of FORMAT.md is
checked: header fields, file length, table CRC, index entry rules, metadata, manifest
consistency, every record's CRC32C and all zero padding. Prints one "OK ..." line per
set and exits 0; on the first problem prints "ERROR: <path>: ..." to stderr and exits 1.
"""
import json
import os
import struct
import sys

MAGIC = b"RDLSHARD"
HEADER = struct.Struct("<8sIIIIQQQQQQII")  # 80 bytes
ENTRY = struct.Struct("<QIIiHHII")  # 32 bytes


class Invalid(Exception):
    pass


def _make_tables():
    """The 256-entry CRC32C table T0, plus T1..T3 (Tk = T0 advanced k zero bytes) for slicing-by-4."""
    t0 = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        t0.append(c)
    tables = [tuple(t0)]
    for _ in range(3):
        tables.append(tuple(t0[c & 0xFF] ^ (c >> 8) for c in tables[-1]))
    return tuple(tables)


_TABLES = _make_tables()


def crc32c(data, crc=0):
    """CRC32C of data; pass a previous result as crc to continue a computation."""
    t0, t1, t2, t3 = _TABLES
    view = memoryview(data).cast("B")
    n = len(view) & ~3
    crc ^= 0xFFFFFFFF
    for (word,) in struct.iter_unpack("<I", view[:n]):  # 4 bytes per step
        crc ^= word
        crc = t3[crc & 0xFF] ^ t2[(crc >> 8) & 0xFF] ^ t1[(crc >> 16) & 0xFF] ^ t0[crc >> 24]
    for b in view[n:]:
        crc = t0[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283
assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283


def check(cond, msg):
    if not cond:
        raise Invalid(msg)


def is_uint(v, bits=64):
    return type(v) is int and 0 <= v < (1 << bits)


def all_zero(data):
    return data.count(0) == len(data)


def _no_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def load_json(data):
    """Parse strict UTF-8 JSON (no NaN/Infinity); raises ValueError or RecursionError."""
    return json.loads(data.decode("utf-8"), parse_constant=_no_constant)


def read_exact(f, offset, n):
    f.seek(offset)
    data = f.read(n)
    check(len(data) == n, f"file truncated: wanted {n} bytes at offset {offset}")
    return data


def read_shard(path, expected_classes, expected_schema):
    """Verify one shard file; return (record_count, file_length, table_crc32c)."""
    size = os.path.getsize(path)
    check(size >= HEADER.size, f"file is {size} bytes, shorter than the 80-byte header")
    with open(path, "rb") as f:
        return _verify(f, size, expected_classes, expected_schema)


def _verify(f, size, expected_classes, expected_schema):
    head = read_exact(f, 0, HEADER.size)
    (magic, version, header_size, page, stride, count, rec_off, rec_end, idx_off,
     meta_off, meta_len, reserved, table_crc) = HEADER.unpack(head)
    check(magic == MAGIC, f"bad magic {magic!r}")
    check(version == 1, f"unsupported version {version}")
    check(header_size == 80, f"header_size is {header_size}, expected 80")
    check(512 <= page <= 1048576 and page & (page - 1) == 0,
          f"page_size {page} is not a power of two in 512..=1048576")
    check(stride == 32, f"index_stride is {stride}, expected 32")
    check(reserved == 0, f"header reserved field is {reserved}, expected 0")
    check(rec_off == page, f"records_offset {rec_off} != page_size {page}")
    check(rec_end >= rec_off, f"records_end {rec_end} < records_offset {rec_off}")
    aligned = -(-rec_end // page) * page
    check(idx_off == aligned, f"index_offset {idx_off} != align_up(records_end, page_size) {aligned}")
    check(meta_off == idx_off + count * stride,
          f"metadata_offset {meta_off} != index_offset + record_count * 32")
    check(size == meta_off + meta_len,
          f"file length {size} != metadata_offset + metadata_length {meta_off + meta_len}")
    check(all_zero(read_exact(f, HEADER.size, rec_off - HEADER.size)),
          f"nonzero byte in header padding 80..{rec_off}")

    index = read_exact(f, idx_off, meta_off - idx_off)
    meta_bytes = read_exact(f, meta_off, meta_len)
    crc = crc32c(meta_bytes, crc32c(index, crc32c(head[:76])))
    check(crc == table_crc, f"table_crc32c is {table_crc:#010x}, computed {crc:#010x}")

    try:
        meta = load_json(meta_bytes)
    except (ValueError, RecursionError) as e:
        raise Invalid(f"metadata is not UTF-8 JSON: {e}") from None
    check(isinstance(meta, dict), "metadata is not a JSON object")
    check(isinstance(meta.get("schema"), str), "metadata 'schema' missing or not a string")
    classes = meta.get("classes")
    check(isinstance(classes, list) and all(isinstance(c, str) for c in classes),
          "metadata 'classes' missing or not an array of strings")
    for key in ("params", "shard"):
        check(key not in meta or isinstance(meta[key], dict), f"metadata '{key}' is not an object")
    check(classes == expected_classes, "metadata classes differ from the manifest's classes")
    check(meta["schema"] == expected_schema, "metadata schema differs from the manifest's schema")

    # Index entry rules 1-5 plus the verify pass (record CRCs, zero padding), in file order.
    pos = rec_off  # end of the previous record (or start of the record region)
    for i in range(count):
        off, length, rcrc, label, _w, _h, flags, res = ENTRY.unpack_from(index, 32 * i)
        where = f"record {i}: "
        check(rec_off <= off and off + length <= rec_end,
              where + f"[{off}, {off + length}) outside records [{rec_off}, {rec_end})")
        check(off >= pos, where + f"offset {off} overlaps or precedes previous record end {pos}")
        if length > page:
            check(off % page == 0, where + f"length {length} > page_size but offset {off} not page-aligned")
        elif length > 0:
            check(off // page == (off + length - 1) // page,
                  where + f"offset {off} length {length} crosses a page boundary")
        check(label >= -1, where + f"label {label} < -1")
        check(not classes or label < len(classes),
              where + f"label {label} out of range for {len(classes)} classes")
        check(flags >> 4 == 0, where + f"reserved flag bits set in {flags:#x}")
        check(flags & 0xF <= 2, where + f"unknown encoding {flags & 0xF}")
        check(res == 0, where + f"reserved field is {res}")
        check(all_zero(read_exact(f, pos, off - pos)), where + f"nonzero padding in [{pos}, {off})")
        got = crc32c(read_exact(f, off, length))
        check(got == rcrc, where + f"crc32c is {rcrc:#010x}, computed {got:#010x}")
        pos = off + length
    check(pos == rec_end, f"records_end {rec_end} != end of last record (or records_offset) {pos}")
    check(all_zero(read_exact(f, pos, idx_off - pos)), f"nonzero padding in [{pos}, {idx_off})")
    return count, size, table_crc


def read_set(directory):
    """Verify one shard set; return a summary line. Raises Invalid with a path prefix."""
    mpath = os.path.join(directory, "manifest.json")
    try:
        with open(mpath, "rb") as f:
            man = load_json(f.read())
        check(isinstance(man, dict), "manifest is not a JSON object")
        check(man.get("format") == "redline-shard", "format is not \"redline-shard\"")
        check(type(man.get("version")) is int and man["version"] == 1, "version is not 1")
        check(isinstance(man.get("schema"), str), "schema missing or not a string")
        check("params" not in man or isinstance(man["params"], dict), "params is not an object")
        classes = man.get("classes")
        check(isinstance(classes, list) and all(isinstance(c, str) for c in classes),
              "classes missing or not an array of strings")
        check(is_uint(man.get("records")), "records missing or not a non-negative integer")
        check(is_uint(man.get("bytes")), "bytes missing or not a non-negative integer")
        shards = man.get("shards")
        check(isinstance(shards, list), "shards missing or not an array")
        for n, s in enumerate(shards):
            check(isinstance(s, dict), f"shards[{n}] is not an object")
            name = s.get("file")
            check(isinstance(name, str) and name not in ("", ".", "..")
                  and not any(c in name for c in "/\\\0"), f"shards[{n}].file is not a plain file name")
            for key, bits in (("records", 64), ("bytes", 64), ("table_crc32c", 32)):
                check(is_uint(s.get(key), bits), f"shards[{n}].{key} missing or out of range")
        check(len({s["file"] for s in shards}) == len(shards), "two shards name the same file")
        check(sum(s["records"] for s in shards) == man["records"], "records != sum over shards")
        check(sum(s["bytes"] for s in shards) == man["bytes"], "bytes != sum over shards")
    except FileNotFoundError:
        raise Invalid(f"{mpath}: no manifest.json in this directory") from None
    except (OSError, ValueError, RecursionError, Invalid) as e:
        raise Invalid(f"{mpath}: {e}") from None

    for s in shards:
        spath = os.path.join(directory, s["file"])
        try:
            count, size, tcrc = read_shard(spath, classes, man["schema"])
            check(count == s["records"], f"record_count {count} != manifest records {s['records']}")
            check(size == s["bytes"], f"file length {size} != manifest bytes {s['bytes']}")
            check(tcrc == s["table_crc32c"],
                  f"table_crc32c {tcrc} != manifest table_crc32c {s['table_crc32c']}")
        except (OSError, ValueError, struct.error, Invalid) as e:
            raise Invalid(f"{spath}: {e}") from None
    return (f"OK {directory}: {len(shards)} shards, {man['records']} records, "
            f"{man['bytes']} bytes, {len(classes)} classes")


def main(argv):
    if len(argv) < 2:
        print("usage: read_shards.py DIR [DIR ...]", file=sys.stderr)
        return 1
    for directory in argv[1:]:
        try:
            if not os.path.isdir(directory):
                raise Invalid(f"{directory}: not a directory")
            print(read_set(directory))
        except Invalid as e:
            print(f"ERROR: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

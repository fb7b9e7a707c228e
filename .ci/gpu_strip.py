"""Wheels trimmed to what the GPU run loads, so `.ci/gpu pack` fits them in `.gpu/`'s budget.

Some wheels kvwire needs on the GPU machine carry much it never loads: UCX's static archives and
benchmarks (libucx-cu13), NIXL's expert-parallel extension, storage plugins and the libraries only those
need (nixl-cu13: 56 MiB, 14 of them kept). A package in TRIMS is repacked as it is packed:

1. members matching its `drop` patterns go;
2. under its `prune` folders (the libraries auditwheel grafted in) a member stays only if it is one of its
   `roots` (loaded by dlopen, not named by anything: UCX's transport modules, NIXL's UCX plugin) or a
   shared library that a kept ELF file names in DT_NEEDED, followed to the end (read from the ELF
   files themselves, so a new release's libraries are followed, not listed here);
3. the RECORD is rewritten to list what is left; the wheel keeps its name (`.ci/gpu run` installs it
   from `.gpu/wheels` with `--no-index`: no index hash to match).

If an ELF file's dynamic section cannot be read, nothing is pruned. Standard library only.
"""

from __future__ import annotations

import csv
import fnmatch
import io
import struct
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

_SHT_DYNAMIC, _DT_NEEDED = 6, 1


@dataclass(frozen=True)
class Trim:
    why: str  # what goes, in a few words (the manifest says it)
    drop: tuple[str, ...] = ()  # fnmatch patterns of members dropped outright (`*` spans folders)
    prune: tuple[str, ...] = ()  # members kept only when needed (DT_NEEDED) or a root
    roots: tuple[str, ...] = ()  # members under `prune` kept anyway: loaded by dlopen


TRIMS = {
    "libucx-cu13": Trim("static archives and UCX's benchmarks (ucx_perftest, io_demo)",
                        drop=("*.a", "*/bin/ucx_perftest", "*/bin/io_demo", "*/ucx/libucx_perftest_*")),
    "nixl-cu13": Trim("nixl_ep (expert parallelism), the example and telemetry programs, every plugin but UCX, "
                      "UCX's benchmarks, and the libraries only those need",
                      drop=("nixl_ep_cu13/*", "nixl_cu13.scripts/*"),
                      prune=("nixl_cu13.libs/*", ".nixl_cu13.mesonpy.libs/*"),
                      roots=("*/libplugin_UCX.so", "nixl_cu13.libs/ucx/libuct_*", "nixl_cu13.libs/ucx/libucm_*")),
}


@dataclass(frozen=True)
class Trimmed:
    path: Path  # the trimmed wheel
    from_bytes: int  # the original wheel's size
    dropped: int  # members left out


def trim_wheel(wheel: Path, trim: Trim, out_dir: Path) -> Trimmed:
    """`wheel` repacked into `out_dir` (same file name) without what `trim` leaves out."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src:
        infos = [i for i in src.infolist() if not i.is_dir()]
        keep = kept_members(src, [i.filename for i in infos], trim)
        part = out.with_suffix(".part")
        with zipfile.ZipFile(part, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in infos:
                if info.filename not in keep:
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = _record(data, keep)
                info.compress_type = zipfile.ZIP_DEFLATED
                dst.writestr(info, data)
    part.replace(out)
    return Trimmed(out, wheel.stat().st_size, len(infos) - len(keep))


def kept_members(src: zipfile.ZipFile, names: list[str], trim: Trim) -> set[str]:
    """The members of `names` that `trim` keeps (see the module's docstring)."""
    names = [n for n in names if not _matches(n, trim.drop)]
    prunable = {n for n in names if _matches(n, trim.prune) and not _matches(n, trim.roots)}
    kept = set(names) - prunable
    by_base: dict[str, list[str]] = defaultdict(list)
    for n in prunable:
        by_base[PurePosixPath(n).name].append(n)
    todo = list(kept)
    while todo:
        name = todo.pop()
        needed = elf_needed(src.read(name)) if _maybe_elf(name) else []
        if needed is None:
            return set(names)  # an ELF file whose needs cannot be read: prune nothing
        for lib in needed:
            for found in by_base.pop(lib, []):
                kept.add(found)
                todo.append(found)
    return kept


def elf_needed(data: bytes) -> list[str] | None:
    """The DT_NEEDED names of a 64-bit little-endian ELF file; [] for anything else; None where an ELF file's
    dynamic section cannot be found through its section headers."""
    if data[:4] != b"\x7fELF":
        return []
    if data[4] != 2 or data[5] != 1:  # not ELF64, or not little-endian: not what these wheels hold
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize) for i in range(shnum)]
    for _, kind, _, _, offset, size, link, _ in sections:
        if kind != _SHT_DYNAMIC:
            continue
        str_offset = sections[link][4]
        names = []
        for pos in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == 0:
                break
            if tag == _DT_NEEDED:
                end = data.index(b"\0", str_offset + value)
                names.append(data[str_offset + value:end].decode())
        return names
    return [] if shnum else None  # a static executable has no dynamic section; no sections at all: unknown


def _record(data: bytes, keep: set[str]) -> bytes:
    rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and r[0] in keep]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue().encode()


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _maybe_elf(name: str) -> bool:
    base = PurePosixPath(name).name
    return ".so" in base or "." not in base  # shared objects and extension modules; programs have no suffix

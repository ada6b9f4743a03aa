"""The native builds' names and the reader build's by-path load, on a CPU machine: a build is
named by every source and header of its extension, and the module the reader's build
subprocess loads by path loads there (no package around it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cudamem.native import cache, reader_build, states
from cudamem.native import (
    cext as _cext,
)
from cudamem.native import (
    fastread as _fastread,
)
from cudamem.native import (
    heapscan as _heapscan,
)
from cudamem.native import reader_toolchain as _native_reader_toolchain
from cudamem.native import (
    spancore as _spancore,
)

EXTENSIONS = [_spancore.EXTENSION, _heapscan.EXTENSION]


@pytest.mark.parametrize("ext", EXTENSIONS, ids=lambda e: e.stem)
def test_every_source_and_header_of_an_extension_names_its_build(
    ext: _cext.Extension, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / ext.stem
    shutil.copytree(ext.source, folder)
    monkeypatch.setattr(ext, "source", str(folder))
    first = ext.key()
    assert ext.key() == first  # the same sources, the same name
    files = cache.sources(str(folder))
    assert files and all(name.endswith(cache.SOURCE_SUFFIXES) for name in files)
    for name in files:
        path = folder / name
        text = path.read_bytes()
        path.write_bytes(text + b"\n")
        assert ext.key() != first, f"a change of {name} keeps the build's name"
        path.write_bytes(text)
        assert ext.key() == first
    (folder / "extra.h").write_text("/* a new header */\n")
    assert ext.key() != first
    name, _ = ext.paths()
    assert name == f"_cudamem_{ext.stem}_{ext.key()[:12]}"


def test_the_digest_reads_path_length_and_bytes(tmp_path: Path) -> None:
    (tmp_path / "a.c").write_text("ab")
    (tmp_path / "b.h").write_text("c")
    (tmp_path / "notes.txt").write_text("not a source")
    one = cache.sources_digest(str(tmp_path), "-O2")
    assert cache.sources(str(tmp_path)) == ["a.c", "b.h"]
    # The same bytes split otherwise between the files: another name.
    (tmp_path / "a.c").write_text("a")
    (tmp_path / "b.h").write_text("bc")
    assert cache.sources_digest(str(tmp_path), "-O2") != one
    (tmp_path / "a.c").write_text("ab")
    (tmp_path / "b.h").write_text("c")
    assert cache.sources_digest(str(tmp_path), "-O2") == one
    assert cache.sources_digest(str(tmp_path), "-O3") != one


def test_the_build_states_are_defined_once() -> None:
    for name in ("IDLE", "BUILDING", "READY", "ACTIVE", "DISABLED", "FAILED", "DROPPED"):
        assert getattr(_cext, name) is getattr(_fastread, name) is getattr(states, name)
    assert _fastread._FINAL is _cext.FINAL is states.FINAL


def test_the_reader_build_loads_by_path_in_a_fresh_process_as_the_build_does(
    tmp_path: Path,
) -> None:
    """The build subprocess runs ``_BOOTSTRAP`` with ``reader_build.py``'s path: done here
    with a library already in place, so that it loads the module, takes the lock and stops
    there, and again to list what the load imported (nothing of cudamem)."""
    name = "_cudamem_reader_probe"
    (tmp_path / (name + reader_build.library_suffix())).write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [sys.executable, "-c", _native_reader_toolchain._BOOTSTRAP, reader_build.__file__]
    argv += [str(tmp_path), name, str(tmp_path / "unused.cpp")]
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    probe = _native_reader_toolchain._BOOTSTRAP.replace(
        "sys.exit(mod.build_main(sys.argv[2:]))\n",
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cudamem'))\n",
    )
    assert probe != _native_reader_toolchain._BOOTSTRAP
    done = subprocess.run(
        [sys.executable, "-c", probe, reader_build.__file__],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_source_of_the_reader_names_its_build(tmp_path: Path) -> None:
    """The reader's build is named by its one translation unit (``bundle``: every part, each
    after a ``#line`` naming it), so a change of any part or of the header builds anew."""
    folder = tmp_path / "fastread"
    shutil.copytree(reader_build.SOURCE_DIR, folder)
    assert sorted(cache.sources(str(folder))) == sorted(reader_build.ORDER)

    def key() -> str:
        return _native_reader_toolchain.cache_key(
            torch_version="2.4",
            cuda_version="12.4",
            cxx11_abi=True,
            source=reader_build.bundle(str(folder)),
        )

    first = key()
    text = reader_build.bundle(str(folder))
    assert text.startswith('#line 1 "fastread/fastread.h"')
    assert '#include "fastread.h"\n' not in text
    for name in reader_build.ORDER:
        assert f'#line 1 "fastread/{name}"' in text
        path = folder / name
        saved = path.read_bytes()
        path.write_bytes(saved + b"\n")
        assert key() != first, f"a change of {name} keeps the reader's build name"
        path.write_bytes(saved)
    assert key() == first
    (folder / "extra.hpp").write_text("// not in ORDER\n")
    with pytest.raises(ValueError, match="the reader's sources are"):
        reader_build.bundle(str(folder))

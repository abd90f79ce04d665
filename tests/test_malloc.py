"""The benchmark processes' restart on huge pages (taso_jax._malloc)."""

from __future__ import annotations

import os
import subprocess
import sys

from taso_jax._malloc import (
    HUGEPAGE_TUNABLE,
    HUGEPAGES_ENV,
    _glibc_with_hugetlb,
    malloc_setting,
    restart_with_hugepages,
)


def _calls(environ, argv=("python", "bench.py", "--x")):
    seen = []
    restart_with_hugepages(list(argv), environ, execve=lambda *a: seen.append(a))
    return seen


def test_the_malloc_setting_is_read_from_the_tunables_among_others():
    on = "glibc.malloc.hugetlb=1" if _glibc_with_hugetlb() else "default"
    assert malloc_setting({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGEPAGE_TUNABLE}"}) == on
    assert malloc_setting({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == "default"
    assert malloc_setting({}) == "default"


def test_a_restart_keeps_the_command_line_and_the_tunables_already_set():
    seen = _calls({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"})
    if not _glibc_with_hugetlb():  # nothing to gain where glibc lacks the tunable
        assert seen == []
        return
    ((exe, argv, env),) = seen
    assert exe == sys.executable and argv == ["python", "bench.py", "--x"]
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGEPAGE_TUNABLE}"
    assert env["PATH"] == "/bin"


def test_no_restart_where_the_tunable_is_in_effect_or_turned_off():
    assert _calls({"GLIBC_TUNABLES": HUGEPAGE_TUNABLE}) == []
    assert _calls({HUGEPAGES_ENV: "off"}) == []
    assert _calls({HUGEPAGES_ENV: "OFF", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == []


def test_a_process_restarted_on_huge_pages_runs_once_more_and_no_more():
    code = ("import os; from taso_jax._malloc import restart_with_hugepages, malloc_setting; "
            "print('start', flush=True); restart_with_hugepages(); print(malloc_setting())")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", HUGEPAGES_ENV)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    if _glibc_with_hugetlb():
        assert out == ["start", "start", HUGEPAGE_TUNABLE]  # the first run, then the restart
    else:
        assert out == ["start", "default"]

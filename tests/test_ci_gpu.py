""".ci/gpu (issue 27): the GPU run's parts that behave the same on any machine.

`pack` needs the package registries and `run` a GPU (or a `--rehearse` packed for this interpreter): both
are run by hand (README, "On a GPU machine"); here, what a machine with no GPU must say, how a step past
its limit ends, and what the report and the pack's grouping make of given inputs.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
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
    report.add(gpu_report.StepResult("tests", ok=False, seconds=13.0, note="exit 1", log="tests.log"))
    text = (tmp_path / "gpu-report.md").read_text()
    assert text.startswith("## GPU run: NVIDIA H100 80GB HBM3")
    assert "1 passed, 1 failed, 0 errors, 2 skipped, in 12 s" in text
    assert "- failure: `tests.a::test_bad`: AssertionError: 3 != 4\n" in text
    assert "- skipped x2: needs 2 CUDA devices, found 1" in text
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
    assert gpu_pack._for_gpu("ucxx-cu12>=0.52") == "ucxx-cu13>=0.52"

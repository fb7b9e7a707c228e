"""`$OUT/gpu-report.md`: what `.ci/gpu run` measured, as markdown to paste into docs/BENCHMARKS.md.

Rewritten whole after each step (`Report.add`), from the steps' results, the machine's facts, the pytest
JUnit XML the tests step leaves beside it, and `.gpu/manifest.json`.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

MIB = 2**20
# how `kvwire bench transfer` heads the UCX protocols NIXL used (bench/report.py PROTOCOL_HEADING), and how it
# says NIXL's rows were skipped
PROTOCOL_HEADING = "NIXL's UCX protocol"
SKIPPED = ": skipped: "


@dataclass
class StepResult:
    name: str
    ok: bool
    seconds: float
    note: str
    log: str = ""
    stdout: str = ""


@dataclass
class Report:
    path: Path
    rehearsal: bool
    commit: str
    manifest: dict
    facts: dict = field(default_factory=dict)
    steps: list[StepResult] = field(default_factory=list)

    def add(self, step: StepResult) -> None:
        self.steps.append(step)
        self.write()

    def write(self) -> None:
        self.path.write_text(self.text())

    def text(self) -> str:
        parts = [self._head(), self._steps()]
        for step in self.steps:
            if step.name == "install" and step.stdout:
                parts.append(f"### pip check (the install's venv)\n\n```\n{step.stdout.strip()}\n```\n")
            if step.name == "bench" and step.stdout:
                parts.append(f"### bench transfer\n\n```\n{step.stdout.strip()}\n```\n")
                parts.append(nixl_section(step.stdout))
            if step.name == "demo":
                parts.append(f"### demo\n\n```\n{step.stdout.strip() or '(no output: demo.log)'}\n```\n")
            if step.name == "tests":
                parts.append(_tests(self.path.parent / "tests.xml"))
        return "\n".join(parts)

    def _head(self) -> str:
        f = self.facts
        title = ("REHEARSAL on a machine with no GPU: these are not GPU figures" if self.rehearsal
                 else f"GPU run: {f.get('gpu', '?')}")
        gone = ", ".join(f"{g['group']} ({g['bytes'] / MIB:.1f} MiB)" for g in self.manifest["left_out"]) or "none"
        rows = [("command", "`.ci/gpu run`" + (" --rehearse" if self.rehearsal else "")),
                ("commit", self.commit), ("date", f.get("date", "?")),
                ("device", f"{f.get('gpus', 0)} x {f.get('gpu', 'no GPU')}, {f.get('memory_gib', '-')} GiB, "
                           f"compute capability {f.get('capability', '-')}, {f.get('sms', '-')} SMs; "
                           f"{f.get('cores', '?')} CPU cores"),
                ("nvidia-smi (name, driver, memory)", f.get("nvidia_smi", "?")),
                ("python, torch, CUDA", f"{f.get('python', '?')}, {f.get('torch', '?')}, {f.get('cuda', '-')}"),
                ("ucxx, UCX", f"{f.get('ucxx', '?')}, {f.get('ucx', '?')}"),
                ("NIXL (the bench's peer, its own UCX)", f.get("nixl", "?")),
                ("not carried (their tests skipped)", gone)]
        if "error" in f:
            rows.append(("facts", f"could not be read: {f['error']}"))
        table = "\n".join(f"| {k} | {v} |" for k, v in rows)
        return f"## {title}\n\n| | |\n| --- | --- |\n{table}\n"

    def _steps(self) -> str:
        rows = "\n".join(f"| {s.name} | {'ok' if s.ok else 'FAILED'} | {s.seconds:.0f} | {s.note} | {s.log} |"
                         for s in self.steps)
        total = sum(s.seconds for s in self.steps)
        return (f"### steps ({total:.0f} s)\n\n| step | result | s | note | log |\n| --- | --- | --- | --- | --- |\n"
                f"{rows}\n")


def nixl_section(bench_stdout: str) -> str:
    """The UCX protocol each NIXL row used, gathered from every bench command's output (or why NIXL's rows
    were skipped), under one heading."""
    lines, inside = [], False
    for line in bench_stdout.splitlines():
        if line.startswith(PROTOCOL_HEADING):
            inside = True
        elif inside and line.startswith("  "):
            lines.append(f"- `{' '.join(line.split()[:5])}`: {' '.join(line.split()[5:])}")
        else:
            inside = False
            if SKIPPED in line and line.split(SKIPPED)[0].startswith("nixl"):
                lines.append(f"- {line.strip()}")
    body = "\n".join(dict.fromkeys(lines)) or "no NIXL rows ran"
    return f"### NIXL's UCX protocol (UCX_PROTO_INFO=y, as the initiator selected it)\n\n{body}\n"


def _tests(xml: Path) -> str:
    """Counts, every failure with its first line, and skips grouped by reason."""
    if not xml.exists():
        return "### tests (pytest -m gpu)\n\nno JUnit XML: the tests step did not finish (tests.log)\n"
    suite = ET.parse(xml).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    assert suite is not None
    cases = suite.findall("testcase")
    failed, bad_kinds, skipped = [], Counter(), Counter()
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for tag in ("failure", "error"):
            if (bad := case.find(tag)) is not None:
                bad_kinds[tag] += 1
                failed.append(f"- {tag}: `{name}`: {(bad.get('message') or '').splitlines()[0][:200]}")
        if (skip := case.find("skipped")) is not None:
            skipped[(skip.get("message") or "").splitlines()[0][:160]] += 1
    n_fail, n_err = bad_kinds["failure"], bad_kinds["error"]
    bad_cases = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
    passed = len(cases) - bad_cases - sum(skipped.values())  # a case can fail and then error in teardown
    lines = ["### tests (pytest -m gpu)\n", f"{passed} passed, {n_fail} failed, {n_err} errors, "
             f"{sum(skipped.values())} skipped, in {float(suite.get('time', 0)):.0f} s\n"]
    lines += failed
    lines += [f"- skipped x{n}: {reason}" for reason, n in skipped.most_common()]
    return "\n".join(lines) + "\n"

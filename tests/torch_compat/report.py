"""Write the table of docs/compatibility.md from a full run (not part of CI).

    PYTHONPATH=$PWD .venv/bin/python -m tests.torch_compat.report RESULTS.jsonl [...] > table.md

Reads the JSON lines written by tests/torch_compat/run_all.py (a later file's record of a
test replaces an earlier one's) and the causes in tests/torch_compat/expected.py, and
prints what docs/compatibility.md carries from "## Result" on, less its notes: the summary
counts, the causes, the failing tests by cause and the per-test table (Markdown). A failing test with no entry in
EXPECTED_TO_DIFFER is printed as "unclassified" so that it gets one.
"""

from __future__ import annotations

import collections
import json
import sys

from tests.torch_compat.expected import CAUSES, CI_EXPECTED_TO_DIFFER, CI_PASSING, EXPECTED_TO_DIFFER


#: test class -> the family the docs count it in (tests/torch_compat/suite.py FAMILIES)
FAMILY_OF = {
    "RpcTest": "RpcTest", "TensorPipeAgentRpcTest": "RpcTest",
    "RemoteModuleTest": "RemoteModuleTest", "ThreeWorkersRemoteModuleTest": "RemoteModuleTest",
    "CudaRemoteModuleTest": "RemoteModuleTest",
    "DistAutogradTest": "DistAutogradTest", "TensorPipeAgentDistAutogradTest": "DistAutogradTest",
}


def main(paths: list[str]) -> int:
    records = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                records[f"{r['cls']}.{r['test']}"] = r
    by_status = collections.Counter(r["status"] for r in records.values())
    passed = by_status["pass"]
    failed = len(records) - passed - by_status["skip"]
    print(f"{len(records)} tests: {passed} pass, {failed} fail, {by_status['skip']} skip.\n")
    families: dict[str, list[dict]] = collections.defaultdict(list)
    for r in records.values():
        families[FAMILY_OF.get(r["cls"], r["cls"])].append(r)
    if len(families) > 1:
        print("| family | tests | pass | fail | skip |")
        print("| --- | --- | --- | --- | --- |")
        for fam, rs in sorted(families.items()):
            c = collections.Counter({"error": "fail"}.get(r["status"], r["status"]) for r in rs)
            print(f"| {fam} | {len(rs)} | {c['pass']} | {c['fail']} | {c['skip']} |")
        print()
    by_cause = collections.Counter()
    for name, r in records.items():
        if r["status"] in ("fail", "error"):
            by_cause[EXPECTED_TO_DIFFER.get(name, ("unclassified", ""))[0]] += 1
    print("| cause | failing tests | outlook |")
    print("| --- | --- | --- |")
    for cause, n in by_cause.most_common():
        print(f"| {cause} | {n} | {CAUSES.get(cause, 'unclassified: needs a cause')} |")
    print("\n## Why the rest fail\n")
    for cause, n in by_cause.most_common():
        print(f"### {cause} ({n})\n\n{CAUSES.get(cause, 'unclassified: needs a cause')}.\n")
        reasons: dict[str, list[str]] = collections.defaultdict(list)
        for name in sorted(records):
            r = records[name]
            if r["status"] in ("fail", "error") and EXPECTED_TO_DIFFER.get(name, ("unclassified", ""))[0] == cause:
                short = name.replace("TensorPipeAgentRpcTest.", "TP.")
                short = short if "RemoteModuleTest." in short else short.replace("RpcTest.", "")
                reasons[EXPECTED_TO_DIFFER.get(name, ("", "no entry in expected.py"))[1]].append(f"`{short}`")
        for why, names in reasons.items():
            print(f"- {why}: {', '.join(names)}")
        print()
    print("## Every test\n")
    print("`rrefrt`: the outcome on rrefrt. `in CI`: run by tests/compat/test_torch_compat.py (`yes`: must pass; "
          "`xfail`: expected to fail until its fix lands).")
    print("\n| test | rrefrt | in CI | cause | why |")
    print("| --- | --- | --- | --- | --- |")
    for name in sorted(records):
        r = records[name]
        status = {"error": "fail"}.get(r["status"], r["status"])
        ci = "yes" if name in CI_PASSING else ("xfail" if name in CI_EXPECTED_TO_DIFFER else "")
        cause, why = EXPECTED_TO_DIFFER.get(name, ("", ""))
        if status == "fail" and not cause:
            cause = "unclassified"
        if status == "skip":
            why = r["detail"].strip().splitlines()[-1][:120] if r["detail"].strip() else ""
        if status == "pass" and cause:
            why = f"now passes (was: {why})"
        print(f"| `{name}` | {status} | {ci} | {cause} | {why.replace('|', '/')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

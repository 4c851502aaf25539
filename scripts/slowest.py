"""The N slowest tests of a scripts/test run, from its groups' JUnit XML reports (pytest
--junitxml; a test's time there is its set-up, call and teardown together).

    python scripts/slowest.py 20 REPORT.xml...
"""
import sys
import xml.etree.ElementTree as ET


def main(top: int, paths: list[str]) -> None:
    timed = []
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as exc:  # a group stopped before it wrote its report
            print(f"[fairshare] slowest tests: {path} unreadable ({exc})", file=sys.stderr)
            continue
        for suite in root.iter("testsuite"):
            group = suite.get("name", "")
            for case in suite.iter("testcase"):
                # classname "tests.scheduling.test_backlog" is the file tests/scheduling/test_backlog.py
                name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name', '')}"
                timed.append((float(case.get("time") or 0), name, group))
    timed.sort(reverse=True)
    print(f"\n[fairshare] the {min(top, len(timed))} slowest of {len(timed)} tests (set-up + call + teardown):")
    for seconds, name, group in timed[:top]:
        print(f"  {seconds:7.1f}s  {name}  [{group}]")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])

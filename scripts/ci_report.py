"""Summarise a pytest junit XML file for .ci/run: tests passed/failed/skipped, and the seconds
spent in the browser module (one pytest-xdist worker) and the Binder module (its tutorials
spread over the workers), beside the rest of the suite.

    python scripts/ci_report.py FILE.xml [PREFIX]
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def main(argv: list[str]) -> int:
    path, prefix = argv[0], (argv[1] if len(argv) > 1 else "")
    root = ET.parse(path).getroot()
    counts: Counter[str] = Counter()
    seconds: Counter[str] = Counter()
    ran: Counter[str] = Counter()
    for case in root.iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        counts[outcome] += 1
        seconds[module] += float(case.get("time") or 0)
        ran[module] += outcome != "skipped"
    print(f"{prefix}{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    for module, label, where in (("test_browser", "browser", "on one worker"),
                                 ("test_binder", "Binder", "summed over the workers that ran its tutorials")):
        if ran[module]:
            print(f"{prefix}{label}: {ran[module]} tests, {seconds[module]:.0f} s {where}, beside the rest")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Print the pytest node ids of the tests that failed or errored in a JUnit XML report.

Usage: python .ci/failed-tests.py REPORT.xml   (one node id per line; nothing if none)
"""
import os
import sys
import xml.etree.ElementTree as ET


def node_id(classname: str, name: str) -> str:
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):   # the longest prefix that is a file; the rest: classes
        path = os.path.join(*parts[:cut]) + ".py"
        if os.path.exists(path):
            return "::".join([path, *parts[cut:], name])
    return f"{classname.replace('.', '/')}.py::{name}"


def main(report: str) -> None:
    seen = []
    for case in ET.parse(report).iter("testcase"):
        if any(child.tag in ("failure", "error") for child in case):
            nid = node_id(case.get("classname", ""), case.get("name", ""))
            if nid not in seen:
                seen.append(nid)
    print("\n".join(seen))


if __name__ == "__main__":
    main(sys.argv[1])

"""The chart's rules (what the schema cannot say) as named groups in templates/validate/, one
file per topic: every group defined there is run by pd-inference.validate exactly once, and no
group is run that is not defined (Helm would fail every render then, but only at render)."""

from __future__ import annotations

import re

from tests import helm

TEMPLATES = helm.CHART / "templates"
DEFINE = re.compile(r'\{\{-? define "(pd-inference\.validate\.[A-Za-z]+)" -?\}\}')
INCLUDE = re.compile(r'\{\{-? include "(pd-inference\.validate\.[A-Za-z]+)" \. -?\}\}')


def test_every_rule_group_is_run_once() -> None:
    defined = [m for f in sorted((TEMPLATES / "validate").glob("*.tpl")) for m in DEFINE.findall(f.read_text())]
    assert len(defined) == len(set(defined)), defined
    entry = (TEMPLATES / "_validate.tpl").read_text()
    run = INCLUDE.findall(entry)
    # pd-inference.validate.ports is also a group (the ports of every rendered pod)
    assert sorted(run) == sorted(defined), (sorted(set(defined) - set(run)), sorted(set(run) - set(defined)))
    assert len(run) == len(set(run))


def test_each_failure_names_a_values_field() -> None:
    """A rule's message starts with the field to change (``field: why``), or the two fields
    that collide (``a and b: why``); a chart bug says so."""
    for f in sorted((TEMPLATES / "validate").glob("*.tpl")):
        for msg in re.findall(r'fail \(?(?:printf )?"([^"]*)', f.read_text()):
            head = msg.split(":", 1)[0]
            fields = head.split(" and ") if head.count(" ") == 2 else [head]
            ok = ":" in msg and (head == "chart bug" or all(" " not in x for x in fields))
            assert ok, f"{f.name}: {msg[:80]}"

"""deploy/grafana/rollmesh.json is a Grafana dashboard over metrics the mesh really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollmesh.telemetry import metrics_catalog as catalog

pytestmark = pytest.mark.unit

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "rollmesh.json"
METRIC_NAME = re.compile(r"\brollmesh_[a-z0-9_]+")


def load_panels() -> tuple[dict, list[dict]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return dashboard, [p for p in dashboard["panels"] if p["type"] != "row"]


def test_the_dashboard_asks_for_a_prometheus_datasource_and_every_panel_uses_it():
    dashboard, panels = load_panels()
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": f"${{{variable['name']}}}"}, panel["title"]
        assert panel["targets"], panel["title"]


def test_every_query_names_only_metrics_the_mesh_exports():
    exported = catalog.exposed_sample_names()
    _, panels = load_panels()
    for panel in panels:
        for target in panel["targets"]:
            names = set(METRIC_NAME.findall(target["expr"]))
            assert names, f"{panel['title']}: {target['expr']} names no rollmesh metric"
            assert names <= exported, f"{panel['title']}: unknown {sorted(names - exported)}"


def test_every_exported_metric_has_a_panel():
    _, panels = load_panels()
    queried = {name for panel in panels for target in panel["targets"]
               for name in METRIC_NAME.findall(target["expr"])}
    for spec in catalog.ALL_METRICS:
        shown = {spec.exposed_name, f"{spec.name}_bucket", f"{spec.name}_count", f"{spec.name}_sum"}
        assert shown & queried, f"no panel shows {spec.name}"

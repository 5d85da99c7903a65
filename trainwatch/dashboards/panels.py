"""Small builders over grafana-foundation-sdk that every trainwatch dashboard uses.

Conventions they enforce, so the dashboards cannot drift apart:
- every panel, query, variable and annotation reads from the `${datasource}`
  variable, never a fixed data source uid;
- every query filters by the `job`, `node` and `rank` variables (and `gpu` on
  the GPU dashboard): the matcher strings below are the only way to spell them;
- every panel has a description saying what to look for;
- panel ids are assigned in order when a dashboard is finished, so they are
  unique and stable.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import heatmap, prometheus as pq, stat, table, timeseries
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm
from grafana_foundation_sdk.models import prometheus as pm

DATASOURCE_UID = "trainwatch-prometheus"
"""The uid of the data source the shipped Grafana provisioning creates; the
dashboards' data source variable defaults to it and falls back to any
Prometheus data source on import."""

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
"""Every panel and variable points at the datasource variable, never a fixed uid."""

# Label matchers. The job's name is `trainwatch_job` (`job` is Prometheus'
# scrape job); the dashboards' variable is still called job. Per-rank series
# take RANK; node aggregates, counters and incidents have no rank label, so
# they take NODE only.
NODE = 'trainwatch_job=~"$job",node=~"$node"'
RANK = NODE + ',rank=~"$rank"'
GPU = RANK + ',gpu=~"$gpu"'

# Every legend names the job: several jobs' lines must not look alike.
RANK_LEGEND = "{{trainwatch_job}} {{node}} rank {{rank}}"
NODE_LEGEND = "{{trainwatch_job}} {{node}}"
GPU_LEGEND = "{{trainwatch_job}} {{node}} gpu {{gpu}}"

STALL_SECONDS = 60
"""Progress age that alert-rules.yml calls a stalled rank; drawn as a threshold line."""
STRAGGLER_RATIO = 1.5
"""Compute slowdown ratio the straggler detector calls a straggler (StragglerConfig.ratio); drawn as a threshold line."""


# ---- queries ------------------------------------------------------------------------


def query(expr: str, legend: str = "", *, instant: bool = False, fmt: pm.PromQueryFormat | None = None) -> pq.Dataquery:
    q = pq.Dataquery().expr(expr).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant()
    if fmt is not None:
        q = q.format(fmt)
    return q


def _with_targets(panel, targets: list[pq.Dataquery]):
    # Grafana keys a panel's queries by refId; give them stable letters.
    for i, target in enumerate(targets):
        panel = panel.with_target(target.ref_id(chr(ord("A") + i)))
    return panel


def _thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=value, color=color) for value, color in steps])
    )


def _common(panel, title: str, description: str, span: int, height: int):
    return panel.title(title).description(description).datasource(DATASOURCE).span(span).height(height)


# ---- bounded queries: a job's spread and its worst ranks, never a line per rank ------

WORST = 5
"""Ranks or nodes a "worst" query draws: enough to see the outliers, few enough to read."""


def node_stat(metric: str, stat: str, extra: str = "") -> str:
    """A node aggregate (trainwatch_node_<metric>) at one statistic."""
    return f'trainwatch_node_{metric}{{{NODE},stat="{stat}"{extra}}}'


def band(metric: str) -> list:
    """The job's spread of a signal from its nodes' aggregates: the lowest rank,
    the median of the nodes' medians, the highest rank. Three lines per job
    whatever its size."""
    return [
        query(f"min by (trainwatch_job) ({node_stat(metric, 'min')})", "{{trainwatch_job}} min"),
        query(f"quantile by (trainwatch_job) (0.5, {node_stat(metric, 'median')})", "{{trainwatch_job}} median"),
        query(f"max by (trainwatch_job) ({node_stat(metric, 'max')})", "{{trainwatch_job}} max"),
    ]


def worst_ranks(metric: str, k: int = WORST, *, lowest: bool = False):
    """The k ranks at the bad end of a per-rank series (`--metrics-detail rank`)."""
    return query(f"{'bottomk' if lowest else 'topk'}({k}, trainwatch_{metric}{{{RANK}}})", RANK_LEGEND)


def worst_nodes(metric: str, stat: str, k: int = 10, *, lowest: bool = False):
    """The k nodes at the bad end of a node aggregate."""
    return query(f"{'bottomk' if lowest else 'topk'}({k}, {node_stat(metric, stat)})", NODE_LEGEND)


# ---- panels -------------------------------------------------------------------------


def graph(
    title: str,
    description: str,
    targets: list[pq.Dataquery],
    *,
    unit: str = "short",
    span: int = 12,
    height: int = 8,
    threshold: float | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    stepped: bool = False,
    bars: bool = False,
    log: int | None = None,
    stacked: bool = False,
) -> timeseries.Panel:
    panel = _common(timeseries.Panel(), title, description, span, height).unit(unit).legend(
        cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST).placement(cm.LegendPlacement.BOTTOM).show_legend(True)
    )
    if threshold is not None:
        # A dashed line at the value the matching alert fires on, so the graph
        # and the page tell the same story.
        panel = panel.thresholds(_thresholds((None, "green"), (threshold, "red"))).thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)
        )
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    if stepped:  # counters that jump: draw the jump where it happened
        panel = panel.line_interpolation(cm.LineInterpolation.STEP_AFTER)
    if bars:  # sparse event counts read better as bars than as a line
        panel = panel.draw_style(cm.GraphDrawStyle.BARS).fill_opacity(80)
    if log is not None:  # values that move by factors (a loss scale halving) on a log axis of this base
        panel = panel.scale_distribution(cb.ScaleDistributionConfig().type(cm.ScaleDistribution.LOG).log(log))
    if stacked:  # parts of one whole (badput by cause): the top line is the total
        panel = panel.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL)).fill_opacity(60)
    return _with_targets(panel, targets)


def single(
    title: str,
    description: str,
    targets: list[pq.Dataquery],
    *,
    unit: str = "short",
    span: int = 6,
    height: int = 4,
    red_at: float | None = None,
    decimals: int | None = None,
) -> stat.Panel:
    panel = (
        _common(stat.Panel(), title, description, span, height)
        .unit(unit)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .graph_mode(cm.BigValueGraphMode.NONE)
        .color_mode(cm.BigValueColorMode.VALUE)
        .no_value("0")
    )
    if decimals is not None:
        panel = panel.decimals(decimals)
    if red_at is not None:
        panel = panel.thresholds(_thresholds((None, "green"), (red_at, "red")))
    return _with_targets(panel, targets)


def grid(
    title: str,
    description: str,
    targets: list[pq.Dataquery],
    hide: list[str],
    *,
    span: int = 8,
    height: int = 8,
    unit: str | None = None,
    red_at: float | None = None,
    sort_by: str | None = None,
) -> table.Panel:
    """A table of instant queries; several targets are joined on their labels."""
    panel = _common(table.Panel(), title, description, span, height)
    if len(targets) > 1:
        panel = panel.with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
    panel = panel.with_transformation(
        dm.DataTransformerConfig(id_val="organize", options={"excludeByName": {name: True for name in hide}})
    )
    if unit is not None:
        panel = panel.unit(unit)
    if red_at is not None:
        panel = panel.thresholds(_thresholds((None, "green"), (red_at, "red")))
    if sort_by is not None:
        panel = panel.sort_by([cb.TableSortByFieldState().display_name(sort_by).desc(True)])
    targets = [t.instant().format(pm.PromQueryFormat.TABLE) for t in targets]
    return _with_targets(panel, targets)


def heat(
    title: str,
    description: str,
    target: pq.Dataquery,
    *,
    unit: str = "s",
    rows: bool = False,
    span: int = 12,
    height: int = 9,
) -> heatmap.Panel:
    """A heatmap of data Prometheus already bucketed: histogram buckets
    (format=heatmap, one row per `le`), or, with rows=True, one row per series
    (one per rank) coloured by its value."""
    panel = (
        _common(heatmap.Panel(), title, description, span, height)
        .calculate(False)
        .color(heatmap.HeatmapColorOptions().mode(hm.HeatmapColorMode.SCHEME).scheme("Oranges").scale(hm.HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(64))
        .cell_gap(1)
        .show_legend()
        .mode(cm.TooltipDisplayMode.SINGLE)
        .show_y_histogram()
    )
    if rows:
        # The colour is the value (seconds); the y axis is the series' name.
        panel = panel.cell_values(heatmap.CellValues().unit(unit)).y_axis(heatmap.YAxisConfig().axis_label("rank"))
    else:
        panel = panel.rows_frame(heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.LE)).y_axis(
            heatmap.YAxisConfig().unit(unit).axis_label("step duration")
        )
        target = target.format(pm.PromQueryFormat.HEATMAP).legend_format("{{le}}")
    return _with_targets(panel, [target])


# ---- variables, annotations, dashboards ---------------------------------------------


def label_variable(name: str, label: str, source: str, label_name: str | None = None) -> db.QueryVariable:
    """A multi-select variable over one label's values (`label_name`, default the
    variable's name); "All" is the regex .* so series that lack a value (a GPU
    not mapped to a rank) still match."""
    return (
        db.QueryVariable(name)
        .label(label)
        .query(f"label_values({source}, {label_name or name})")
        .datasource(DATASOURCE)
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.NATURAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
    )


class PromAnnotation(dm.AnnotationQuery):
    """A Prometheus annotation query. The SDK's model stops at `expr`; Grafana's
    Prometheus data source also reads step, titleFormat, textFormat and tagKeys,
    which place one marker per series step where the expression is non-empty."""

    def __init__(self, name: str, expr: str, color: str, title: str, text: str, tag_keys: str):
        super().__init__(name=name, datasource=DATASOURCE, enable=True, hide=False, icon_color=color, expr=expr)
        self.extra = {"step": "15s", "titleFormat": title, "textFormat": text, "tagKeys": tag_keys,
                      "useValueForTime": False}

    def to_json(self) -> dict[str, object]:
        return super().to_json() | self.extra


class _Built:
    """Adapter: the SDK's Dashboard.annotation() takes a builder."""

    def __init__(self, value):
        self.value = value

    def build(self):
        return self.value


ANNOTATIONS = (
    PromAnnotation(
        "Incidents",
        # One marker per scrape step in which a kind's counter went up.
        f"sum by (trainwatch_job, node, kind) (changes(trainwatch_incidents_total{{{NODE}}}[1m])) > 0",
        "red",
        "{{kind}} incident",
        "trainwatch job {{trainwatch_job}} on {{node}}: `trainwatch diagnose {{trainwatch_job}}` explains it",
        "kind,trainwatch_job",
    ),
    PromAnnotation(
        "Restarts",
        f"sum by (trainwatch_job, node) (changes(trainwatch_restarts_total{{{NODE}}}[1m])) > 0",
        "orange",
        "worker group restart",
        "trainwatch job {{trainwatch_job}} on {{node}} restarted its ranks from the newest valid checkpoint",
        "trainwatch_job",
    ),
)


def base(uid: str, title: str, description: str) -> db.Dashboard:
    b = (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["trainwatch"])
        .editable()
        .refresh("10s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .link(
            db.DashboardLink("trainwatch")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(["trainwatch"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
        .with_variable(
            db.DatasourceVariable("datasource")
            .label("Data source")
            .type("prometheus")
            .current(dm.VariableOption(selected=True, text="trainwatch", value=DATASOURCE_UID))
        )
        # Every node exports its restart counter at every --metrics-detail; per-rank
        # series only at `rank` (the Rank variable is then empty and matches all).
        .with_variable(label_variable("job", "Job", "trainwatch_restarts_total", "trainwatch_job"))
        .with_variable(label_variable("node", "Node", 'trainwatch_restarts_total{trainwatch_job=~"$job"}'))
        .with_variable(label_variable("rank", "Rank", 'trainwatch_step{trainwatch_job=~"$job",node=~"$node"}'))
    )
    for annotation in ANNOTATIONS:
        b = b.annotation(_Built(annotation))
    return b


def finish(builder: db.Dashboard) -> dm.Dashboard:
    dash = builder.build()
    # Stable, unique panel ids: Grafana uses them in links, and a regenerated
    # dashboard must not renumber panels that did not change.
    for i, panel in enumerate(dash.panels or [], start=1):
        panel.id_val = i
    return dash

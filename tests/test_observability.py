"""Observability: the Grafana dashboard and its provisioning files, the metrics the processes
export, and a real Prometheus scraping a real training run.

One training run (Mosquitto, 3 device processes, a controller, all with ``--metrics-port``) is
shared by the module; it trains for many epochs and is killed at the end, so every test here
looks at processes that are still training.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ftpipe_iot.protocol.vocab import DropReason, FailureCause
from ftpipe_iot.runtime.broker import BrokerKind, BrokerProcess, find_free_port, mosquitto_binary

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "ftpipe-fleet.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "ftpipe.yml"

# Concrete values for the Grafana variables the dashboard uses, as Grafana would fill them in
# for a short time range at a 1 s scrape interval.
GRAFANA_VARIABLES = {
    "$__rate_interval": "10s",
    "$__interval": "2s",
    "$__range": "5m",
    "$device": ".*",
}

_METRIC = re.compile(r"\bftpipe_[a-z0-9_]+\b")
# Annotation queries fire only where the expression is > 0; the series behind them must exist.
_ANNOTATION_FILTER = re.compile(r"\s*>\s*0\s*$")


@dataclass(frozen=True)
class Query:
    """One PromQL expression of the dashboard and where it is."""

    where: str
    expr: str
    annotation: bool = False

    def concrete(self) -> str:
        """The expression with Grafana variables substituted (and, for an annotation, without
        its ``> 0`` filter, so that the query returns the series even when nothing happened)."""
        expr = self.expr
        for name, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
            expr = expr.replace(name, value)
        if self.annotation:
            expr = _ANNOTATION_FILTER.sub("", expr)
        assert "$" not in expr, f"{self.where}: unsubstituted variable in {expr!r}"
        return expr

    @property
    def metrics(self) -> set[str]:
        return set(_METRIC.findall(self.expr))


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(dashboard: dict | None = None) -> list[Query]:
    """Every PromQL ``expr`` of the dashboard: panel targets, annotations, variable queries."""
    dashboard = dashboard or load_dashboard()
    queries: list[Query] = []
    for panel in _all_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            if target.get("expr"):
                queries.append(Query(f"panel {panel['title']!r} {target['refId']}",
                                     target["expr"]))
    for ann in dashboard.get("annotations", {}).get("list", []):
        if ann.get("expr"):
            queries.append(Query(f"annotation {ann['name']!r}", ann["expr"], annotation=True))
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        match = re.fullmatch(r"label_values\((.+),\s*\w+\)", text or "")
        if match:
            queries.append(Query(f"variable {var['name']!r}", match.group(1)))
    return queries


def _all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(_all_panels(panel.get("panels", [])))
    return out


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested panels included."""
    return _all_panels(dashboard["panels"])


def dashboard_metric_names() -> list[str]:
    return sorted(set().union(*(q.metrics for q in dashboard_queries())))


def free_port() -> int:
    """A free port below the ephemeral range (see ``find_free_port``)."""
    return find_free_port()


def scrape(port: int, timeout_s: float = 2.0) -> dict[str, float]:
    """Every sample of a process's ``/metrics`` as {name{labels}: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def sample_names(samples: dict[str, float]) -> set[str]:
    return {key.split("{", 1)[0] for key in samples}


def poll(what: str, check, timeout_s: float, interval_s: float = 0.2):
    """Call ``check`` until it returns something truthy; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
        except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
            last_error, result = exc, None
        if result:
            return result
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}"
                         + (f" (last error: {last_error})" if last_error else ""))


def prometheus_binary() -> str | None:
    found = shutil.which("prometheus")
    if found:
        return found
    return "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None


class PrometheusServer:
    """A Prometheus of the test's own: free port, own config and temporary storage."""

    def __init__(self, work_dir: Path, jobs: dict[str, list[int]],
                 scrape_interval: str = "1s") -> None:
        binary = prometheus_binary()
        if binary is None:
            raise RuntimeError("prometheus is not installed; scripts/install-system-deps.sh "
                               "(run by make test and .ci/run) installs it "
                               "(apt-get install prometheus)")
        self.binary = binary
        self.work_dir = work_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        work_dir.mkdir(parents=True, exist_ok=True)
        self.config = work_dir / "prometheus.yml"
        lines = ["global:", f"  scrape_interval: {scrape_interval}",
                 f"  scrape_timeout: {scrape_interval}", "scrape_configs:"]
        for job, ports in jobs.items():
            targets = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
            lines += [f"  - job_name: {job}", "    static_configs:",
                      f"      - targets: [{targets}]"]
        self.config.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None
        self.log_path = work_dir / "prometheus.log"

    def start(self, timeout_s: float = 30.0) -> None:
        log = open(self.log_path, "w")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}",
             f"--storage.tsdb.path={self.work_dir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n"
                                     f"{self.log_path.read_text()[-2000:]}")
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                return resp.status == 200

        poll("prometheus to be ready", ready, timeout_s)

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant query via the HTTP API; the result vector (raises on an error status)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # 400 carries PromQL errors in its body
            body = json.loads(exc.read())
        if body.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {body.get('error')}")
        return body["data"]["result"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- the shared training run -------------------------------------------------------------------

DEVICES = ("dev0", "dev1", "dev2")


@dataclass
class TrainingRun:
    """Processes of the shared run and where their metrics are."""

    controller_port: int
    device_ports: dict[str, int]
    prometheus: PrometheusServer | None
    prometheus_error: str | None

    @property
    def ports(self) -> dict[str, int]:
        return {"controller": self.controller_port, **self.device_ports}


@pytest.fixture(scope="module")
def training_run(tmp_path_factory) -> Iterator[TrainingRun]:
    from helpers import Processes

    if mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed; .ci/run installs it (apt-get install mosquitto)")
    work = tmp_path_factory.mktemp("observability")
    controller_port = free_port()
    device_ports = {name: free_port() for name in DEVICES}
    prometheus: PrometheusServer | None = None
    error: str | None = None
    try:
        prometheus = PrometheusServer(work / "prometheus", {
            "ftpipe-controller": [controller_port],
            "ftpipe-device": list(device_ports.values())})
    except RuntimeError as exc:
        error = str(exc)  # only the Prometheus test fails on this; the scrape tests still run
    broker = BrokerProcess(kind=BrokerKind.MOSQUITTO, data_dir=work / "broker")
    procs = Processes(work / "logs")
    try:
        if prometheus is not None:
            prometheus.start()
        broker.start()
        job = "obs"
        for name, port in device_ports.items():
            procs.device(name, job, broker.url, "--metrics-port", str(port))
        procs.start("controller", "controller", "--job", job, "--broker", broker.url,
                    "--devices", str(len(DEVICES)), "--epochs", "50",
                    # A steady run: the metrics are registered whether or not a repartition
                    # happens, and a plan change mid-test would only add noise.
                    "--no-repartition",
                    "--metrics-port", str(controller_port))

        def training() -> bool:
            for name, proc in procs.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{name} exited with {proc.returncode}:\n"
                                         f"{procs.log(name)[-3000:]}")
            return scrape(controller_port).get("ftpipe_training_step", 0) >= 5

        poll("the controller to complete 5 steps", training, timeout_s=90)
        yield TrainingRun(controller_port, device_ports, prometheus, error)
    finally:
        procs.stop_all()
        if prometheus is not None:
            prometheus.stop()
        broker.cleanup()


@pytest.fixture(scope="module")
def exported_names(training_run) -> dict[str, set[str]]:
    """Sample names each process exports, scraped while training."""
    return {name: sample_names(scrape(port)) for name, port in training_run.ports.items()}


# -- 1. every metric the dashboard uses is exported --------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("metric", dashboard_metric_names())
def test_dashboard_metric_is_exported_by_a_training_process(metric, exported_names):
    exporters = [name for name, names in exported_names.items() if metric in names]
    assert exporters, (f"{metric} is used by the dashboard but no running process exports it; "
                       f"exported: {sorted(set().union(*exported_names.values()))}")


def test_dashboard_uses_metrics_at_all():
    # Guards the extraction above: a regex that matched nothing would make test 1 vacuous.
    names = dashboard_metric_names()
    assert len(names) >= 20 and "ftpipe_training_loss" in names
    assert all(q.metrics for q in dashboard_queries()), "a query without any ftpipe_ metric"


@pytest.mark.slow
def test_label_values_are_exported_from_the_start(training_run):
    """Labelled counters export nothing until a label set is used: the known failure causes and
    drop reasons are pre-initialised, so rate() and alerts work before the first event."""
    controller = scrape(training_run.controller_port)
    for cause in FailureCause:
        assert f'ftpipe_failures_total{{cause="{cause.value}"}}' in controller
    for name, port in training_run.ports.items():
        samples = scrape(port)
        for reason in DropReason:
            assert f'ftpipe_messages_dropped_total{{reason="{reason.value}"}}' in samples, name


# -- 2. the dashboard and the provisioning files --------------------------------------------------

def _provisioned_uid() -> str:
    config = yaml.safe_load(DATASOURCES.read_text())
    assert config["apiVersion"] == 1
    (source,) = config["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
    return source["uid"]


def test_provisioning_files_parse_and_point_at_the_dashboards():
    uid = _provisioned_uid()
    assert uid == "ftpipe-prometheus"
    providers = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    scrape_config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape_config["scrape_configs"]}
    assert set(jobs) == {"ftpipe-controller", "ftpipe-device"}
    # The example's ports are those of `ftpipe-iot demo --metrics-port-base 9400`.
    targets = [t for j in jobs.values() for sc in j["static_configs"] for t in sc["targets"]]
    assert targets == ["localhost:9400", "localhost:9401", "localhost:9402", "localhost:9403"]
    promtool = shutil.which("promtool")
    if promtool:  # shipped with the prometheus package; the parse above is the fallback check
        out = subprocess.run([promtool, "check", "config", str(GRAFANA / "prometheus.yml")],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_is_valid_and_uses_only_the_provisioned_datasource():
    uid = _provisioned_uid()
    text = DASHBOARD.read_text()
    dashboard = json.loads(text)
    assert "${DS_" not in text and "__inputs" not in dashboard, "import placeholders left in"
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid, panel["title"]
            assert target["expr"].strip(), panel["title"]
    for ann in dashboard["annotations"]["list"]:
        if ann.get("builtIn"):
            continue
        assert ann["datasource"]["uid"] == uid, ann["name"]
    for var in dashboard["templating"]["list"]:
        assert var["datasource"]["uid"] == uid, var["name"]
    titles = {p["title"] for p in panels}
    for needed in ("Throughput", "Training loss", "Test accuracy", "Devices online",
                   "Stage compute time per device", "Capacity factor per device",
                   "Messages dropped by reason", "Bytes sent and received"):
        assert needed in titles
    names = {a["name"] for a in dashboard["annotations"]["list"]}
    assert {"Plan changes", "Failures", "Repartitions"} <= names


# -- 3. a real Prometheus scrapes the run; every dashboard query returns data -------------------

def _prometheus(training_run) -> PrometheusServer:
    if training_run.prometheus is None:
        pytest.fail(training_run.prometheus_error or "prometheus did not start")
    return training_run.prometheus


@pytest.fixture(scope="module")
def scraped_prometheus(training_run) -> PrometheusServer:
    """Prometheus once it has scraped every process several times during training (rate()
    needs two samples inside its window)."""
    prometheus = _prometheus(training_run)

    def scraped() -> bool:
        up = prometheus.query("count_over_time(up[30s]) >= 4 and up == 1")
        steps = prometheus.query("ftpipe_training_step > 0")
        return len(up) == 1 + len(DEVICES) and bool(steps)

    poll("prometheus to scrape the controller and every device 4 times", scraped, timeout_s=40)
    return prometheus


@pytest.mark.slow
@pytest.mark.parametrize("query", dashboard_queries(), ids=lambda q: q.where)
def test_dashboard_query_returns_data_from_prometheus(query, scraped_prometheus):
    expr = query.concrete()
    # A fresh rate() may need one more scrape: poll briefly instead of failing on the first try.
    result = poll(f"{query.where} ({expr}) to return data",
                  lambda: scraped_prometheus.query(expr), timeout_s=10, interval_s=0.5)
    assert result


@pytest.mark.slow
def test_prometheus_sees_training_progress_over_time(scraped_prometheus):
    """Not only present: the step counter grows in Prometheus as the run trains."""
    first = float(scraped_prometheus.query("ftpipe_training_step")[0]["value"][1])
    poll("ftpipe_training_step to grow in prometheus",
         lambda: float(scraped_prometheus.query("ftpipe_training_step")[0]["value"][1]) > first,
         timeout_s=20)
    rate = scraped_prometheus.query("rate(ftpipe_training_samples_total[10s])")
    assert float(rate[0]["value"][1]) > 0

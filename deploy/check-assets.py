"""The checks deploy/check does in Python: reading YAML and JSON and comparing what the assets say with
each other and with a running proxy's /metrics. Run by deploy/check with the tools venv's python (PyYAML);
each subcommand prints what it checked and exits 1 with one line per problem.

  alerts-tested RULES TESTS          every alert fires in some test, and the quiet test lists each as silent
  dashboard-exprs DASHBOARD OUT      checks the dashboard's shape; writes its PromQL as a rule file to OUT
  metric-refs METRICS_TEXT FILE...   every idemproxy_ metric, and every outcome/op/status/le value, used in
                                     the rule files and dashboards exists in the scraped exposition
  metrics-table METRICS_TEXT DOC     the table under DOC's "## Metrics" has one row per idemproxy_ family in
                                     the scraped exposition, and no row for a family it does not serve
  kubernetes DIR                     the manifests agree with each other and are hardened
  configmap-toml CONFIGMAP OUT       writes the ConfigMap's idemproxy.toml to OUT
"""

import json
import re
import sys
from pathlib import Path

import yaml

problems = []


def problem(text):
    problems.append(text)


def finish(what):
    if problems:
        for text in dict.fromkeys(problems):
            print(f"  problem: {text}")
        sys.exit(1)
    print(f"  ok: {what}")


# Grafana's variables, replaced by what they stand for in a query Prometheus can parse.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "${__rate_interval}": "5m",
    "$__interval": "1m",
    "${__interval}": "1m",
    "$__range": "1h",
    "${__range}": "1h",
    "$job": "idemproxy",
    "${job}": "idemproxy",
    "$instance": ".*",
    "${instance}": ".*",
}


def substitute(expr):
    for variable in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(variable, GRAFANA_VARIABLES[variable])
    left = re.findall(r"\$\{?\w+\}?", expr)
    if left:
        problem(f"unknown Grafana variable {left} in: {expr}")
    return expr


def alerts_tested(rules_path, tests_path):
    rules = yaml.safe_load(Path(rules_path).read_text())
    tests = yaml.safe_load(Path(tests_path).read_text())
    alerts = [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]
    fired, quiet = set(), set()
    for test in tests["tests"]:
        for case in test.get("alert_rule_test", []):
            if case.get("exp_alerts"):
                fired.add(case["alertname"])
            elif test.get("name") == "quiet":
                quiet.add(case["alertname"])
    for alert in alerts:
        if alert not in fired:
            problem(f"{alert} fires in no test case of {tests_path}")
        if alert not in quiet:
            problem(f"{alert} is not checked silent in the quiet test of {tests_path}")
    finish(f"{len(alerts)} alerts each fire in a test and stay silent in the quiet one")


def panels_of(dashboard):
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs(path, out):
    dashboard = json.loads(Path(path).read_text())
    inputs = [i.get("name") for i in dashboard.get("__inputs", [])]
    if "DS_PROMETHEUS" not in inputs:
        problem("__inputs has no DS_PROMETHEUS")
    variables = [v["name"] for v in dashboard.get("templating", {}).get("list", [])]
    if "DS_PROMETHEUS" not in variables:
        problem("no DS_PROMETHEUS data source variable (provisioned dashboards need it)")
    ids, rules = set(), []
    for panel in panels_of(dashboard):
        if panel.get("id") in ids:
            problem(f"panel id {panel.get('id')} used twice")
        ids.add(panel.get("id"))
        if panel.get("type") == "row":
            continue
        title = panel.get("title", "?")
        for thing in [panel] + panel.get("targets", []):
            uid = thing.get("datasource", {}).get("uid")
            if uid != "${DS_PROMETHEUS}":
                problem(f"panel {title!r}: data source {uid!r}, not ${{DS_PROMETHEUS}}")
        if not panel.get("targets"):
            problem(f"panel {title!r} has no query")
        for target in panel.get("targets", []):
            rules.append({"record": f"dashboard:panel_{panel['id']}_{target['refId']}:expr",
                          "expr": substitute(target["expr"])})
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict) and not query.get("query", "").startswith("label_values("):
            problem(f"variable {variable['name']}: unexpected query {query}")
    Path(out).write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, sort_keys=False))
    finish(f"{path}: {len(ids)} panels, {len(rules)} queries, every one on ${{DS_PROMETHEUS}}")


def exprs_in(path):
    text = Path(path).read_text()
    if path.endswith(".json"):
        dashboard = json.loads(text)
        exprs = [t["expr"] for p in panels_of(dashboard) for t in p.get("targets", [])]
        for variable in dashboard.get("templating", {}).get("list", []):
            query = variable.get("query")
            if isinstance(query, dict):
                exprs.append(query.get("query", ""))
        return [substitute(e) for e in exprs]
    rules = yaml.safe_load(text)
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def exposition(path):
    """Family names, and the values each label takes, in a Prometheus text exposition."""
    families, values = set(), {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            families.add(name)
            if kind == "histogram":
                families.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
        elif line and not line.startswith("#"):
            for label, value in re.findall(r'(\w+)="([^"]*)"', line):
                values.setdefault(label, set()).add(value)
    return families, values


def metric_refs(metrics_path, files):
    families, values = exposition(metrics_path)
    used = set()
    for path in files:
        for expr in exprs_in(path):
            for name in re.findall(r"\bidemproxy_[a-z0-9_]+\b", expr):
                used.add(name)
                if name not in families:
                    problem(f"{path}: {name} is not in a running proxy's /metrics")
            for label, op, value in re.findall(r'\b(outcome|op|status|le)\s*(=~|!~|=|!=)\s*"([^"]*)"', expr):
                wanted = value.split("|") if op in ("=~", "!~") else [value]
                for one in wanted:
                    if one not in values.get(label, set()):
                        problem(f'{path}: {label}="{one}" is not a value /metrics has')
    finish(f"{len(used)} metric names and their label values, used by {len(files)} files, are served")


def metrics_table(metrics_path, doc_path):
    served = set()
    for line in Path(metrics_path).read_text().splitlines():
        if line.startswith("# TYPE idemproxy_"):
            served.add(line.split()[2])
    text = Path(doc_path).read_text()
    if "\n## Metrics\n" not in text:
        problem(f"{doc_path} has no ## Metrics section")
        finish("")
    section = text.split("\n## Metrics\n", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(idemproxy_[a-z0-9_]+)", section, re.M)
    for name in sorted(served - set(rows)):
        problem(f"{name} is served but has no row in the table of {doc_path}")
    for name in sorted(set(rows) - served):
        problem(f"{doc_path} has a row for {name}, which a running proxy does not serve")
    for name in sorted({n for n in rows if rows.count(n) > 1}):
        problem(f"{doc_path} has more than one row for {name}")
    finish(f"{len(served)} served idemproxy_ families, each with one row in {doc_path}")


def kubernetes(directory):
    docs = []
    for path in sorted(Path(directory).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    by_kind = {}
    for name, doc in docs:
        by_kind.setdefault(doc["kind"], []).append((name, doc))

    def subset(selector, labels):
        return all(labels.get(k) == v for k, v in selector.items())

    secrets = {d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {}))
               for _, d in by_kind.get("Secret", [])}
    configmaps = {d["metadata"]["name"] for _, d in by_kind.get("ConfigMap", [])}
    deployments = by_kind.get("Deployment", [])
    if not deployments:
        problem("no Deployment")
    forms = set()
    for file, deployment in deployments:
        spec = deployment["spec"]
        pod = spec["template"]["spec"]
        labels = spec["template"]["metadata"]["labels"]
        if not subset(spec["selector"]["matchLabels"], labels):
            problem(f"{file}: the selector does not match the pod's labels")
        annotations = spec["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true" or annotations.get("prometheus.io/port") != "9090":
            problem(f"{file}: no prometheus.io scrape annotations for port 9090")
        pod_security = pod.get("securityContext", {})
        if pod_security.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            problem(f"{file}: the pod's seccompProfile is not RuntimeDefault")
        containers = pod.get("initContainers", []) + pod["containers"]
        ports = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        proxies = [c for c in containers if c["image"].startswith("idemproxy:") and "serve" in c.get("args", [])]
        if len(proxies) != 1:
            problem(f"{file}: {len(proxies)} idemproxy serve containers, not 1")
        for container in containers:
            where = f"{file}: container {container['name']}"
            security = container.get("securityContext", {})
            if not (security.get("runAsNonRoot") or pod_security.get("runAsNonRoot")):
                problem(f"{where} may run as root")
            if security.get("allowPrivilegeEscalation") is not False:
                problem(f"{where}: allowPrivilegeEscalation is not false")
            if security.get("readOnlyRootFilesystem") is not True:
                problem(f"{where}: the root filesystem is writable")
            if security.get("capabilities", {}).get("drop") != ["ALL"]:
                problem(f"{where}: capabilities are not all dropped")
            if security.get("seccompProfile", pod_security.get("seccompProfile", {})).get("type") != "RuntimeDefault":
                problem(f"{where}: seccomp is not RuntimeDefault")
            requests = container.get("resources", {}).get("requests", {})
            if not {"cpu", "memory"} <= set(requests) or "memory" not in container["resources"].get("limits", {}):
                problem(f"{where}: needs cpu and memory requests and a memory limit")
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["key"] not in secrets.get(ref["name"], set()):
                    problem(f"{where}: {env['name']} names {ref['name']}/{ref['key']}, which secret.yaml lacks")
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    problem(f"{where}: mounts unknown volume {mount['name']}")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                action = container.get(probe, {})
                port = (action.get("httpGet") or action.get("tcpSocket") or {}).get("port")
                if port is not None and port not in ports:
                    problem(f"{where}: {probe} on unknown port {port}")
        for proxy in proxies:
            where = f"{file}: container {proxy['name']}"
            args = proxy.get("args", [])
            if "--no-migrate" not in args or args[args.index("--config") + 1] != "/etc/idemproxy/idemproxy.toml":
                problem(f"{where}: must serve --no-migrate with --config /etc/idemproxy/idemproxy.toml")
            if proxy.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/readyz":
                problem(f"{where}: readiness is not /readyz")
            if proxy.get("livenessProbe", {}).get("httpGet", {}).get("path") != "/healthz":
                problem(f"{where}: liveness is not /healthz")
            mounts = {m["mountPath"]: m["name"] for m in proxy.get("volumeMounts", [])}
            config = volumes.get(mounts.get("/etc/idemproxy"), {}).get("configMap", {}).get("name")
            if config not in configmaps:
                problem(f"{where}: /etc/idemproxy is not a ConfigMap of configmap.yaml")
            if "emptyDir" not in volumes.get(mounts.get("/var/lib/idemproxy"), {}):
                problem(f"{where}: /var/lib/idemproxy is not an emptyDir")
            env = {e["name"] for e in proxy.get("env", [])}
            if "IDEMPROXY_STORE__URL" not in env:
                problem(f"{where}: no IDEMPROXY_STORE__URL")
            native = proxy in pod.get("initContainers", [])
            if native and proxy.get("restartPolicy") != "Always":
                problem(f"{where}: an init container without restartPolicy Always")
            forms.add("native sidecar" if native else "two containers")
        # Every other container of the pod is the app: reached only through the proxy, over loopback.
        for app in (c for c in pod["containers"] if not c["image"].startswith("idemproxy:")):
            where = f"{file}: container {app['name']}"
            if app.get("ports"):
                problem(f"{where} declares ports; the app is reached through idemproxy only")
            binds = [a for a in app.get("command", []) + app.get("args", []) if re.fullmatch(r"[\d.]+:\d+", a)]
            if not binds or not all(a.startswith("127.0.0.1:") for a in binds):
                problem(f"{where} does not listen on loopback only: {binds}")
        migrations = [c for c in pod.get("initContainers", []) if "migrate" in c.get("args", [])]
        if not migrations:
            problem(f"{file}: no init container runs idemproxy migrate")
        for service_file, service in by_kind.get("Service", []):
            if not subset(service["spec"]["selector"], labels):
                problem(f"{service_file}: selects no pod of {file}")
            for port in service["spec"]["ports"]:
                if port["targetPort"] not in ports:
                    problem(f"{service_file}: targetPort {port['targetPort']} is no port of {file}")
        for kind in ("PodDisruptionBudget", "NetworkPolicy"):
            for other_file, other in by_kind.get(kind, []):
                selector = other["spec"].get("selector") or other["spec"].get("podSelector")
                if not subset(selector["matchLabels"], labels):
                    problem(f"{other_file}: selects no pod of {file}")
                for rule in other["spec"].get("ingress", []):
                    for port in rule.get("ports", []):
                        if port["port"] not in ports:
                            problem(f"{other_file}: port {port['port']} is no port of {file}")
    if forms != {"native sidecar", "two containers"}:
        problem(f"Deployment forms found: {sorted(forms)}; want the native sidecar and two containers")
    services = by_kind.get("Service", [])
    for file, monitor in by_kind.get("ServiceMonitor", []):
        matched = [s for _, s in services if subset(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        if not matched:
            problem(f"{file}: selects no Service")
        for endpoint in monitor["spec"]["endpoints"]:
            if not any(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in matched):
                problem(f"{file}: port {endpoint['port']} is no port of the Service")
    if not by_kind.get("ServiceMonitor"):
        problem("no ServiceMonitor")
    if not by_kind.get("PodDisruptionBudget"):
        problem("no PodDisruptionBudget")
    finish(f"{len(docs)} manifests agree (selectors, ports, Secret keys, volumes) and every container is hardened")


def configmap_toml(path, out):
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    text = docs[0]["data"]["idemproxy.toml"]
    Path(out).write_text(text)


def main():
    command, *args = sys.argv[1:]
    {
        "alerts-tested": alerts_tested,
        "dashboard-exprs": dashboard_exprs,
        "metric-refs": lambda metrics, *files: metric_refs(metrics, files),
        "metrics-table": metrics_table,
        "kubernetes": kubernetes,
        "configmap-toml": configmap_toml,
    }[command](*args)


if __name__ == "__main__":
    main()

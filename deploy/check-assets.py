"""The checks deploy/check does in Python: reading YAML and JSON and comparing what the assets say with
each other and with a running proxy's /metrics. Run by deploy/check with the tools venv's python (PyYAML);
each subcommand prints what it checked and exits 1 with one line per problem.

  alerts-tested RULES TESTS          every alert fires in some test, and the quiet test lists each as silent
  dashboard-exprs DASHBOARD OUT      checks the dashboard's shape; writes its PromQL as a rule file to OUT
  metric-refs METRICS_TEXT FILE...   every idemproxy_ metric, and every outcome/op/status/le value, used in
                                     the rule files and dashboards exists in the scraped exposition
  metrics-table METRICS_TEXT DOC     the table under DOC's "## Metrics" has one row per idemproxy_ family in
                                     the scraped exposition, and no row for a family it does not serve
  kubernetes ALERTS RENDERED...      each rendered overlay (kubectl kustomize output) agrees with itself,
                                     is hardened, and carries ALERTS as its PrometheusRule; together they
                                     have both Deployment forms
  kubernetes-own ALERTS RENDERED     the same checks of one overlay of one form (an example of your own)
  operator-crds RENDERED...          their ServiceMonitor and PrometheusRule against the Prometheus
                                     Operator's schemas (cloudcoil's models), unknown fields refused
  configmap-toml RENDERED OUT        writes the idemproxy.toml of the ConfigMap the proxy mounts to OUT
  config-rolls BEFORE AFTER          two renders around an edit of idemproxy.toml: the pod template
                                     changed, in the name of the mounted ConfigMap only
  prometheusrule-groups RENDERED OUT writes the PrometheusRule's groups to OUT as a rule file
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


def rendered(path):
    """The documents of one rendered overlay (`kubectl kustomize` output), grouped by kind."""
    by_kind = {}
    for doc in yaml.safe_load_all(Path(path).read_text()):
        if doc:
            by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def subset(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def is_idemproxy(container):
    """Whether the container runs idemproxy's image, under whatever registry and tag an overlay gives it."""
    return re.match(r"(.+/)?idemproxy[:@]", container["image"]) is not None


# The suffix kustomize's configMapGenerator hashes from the content: while the Deployment mounts a
# ConfigMap named so, a changed config is a changed pod template.
HASHED = re.compile(r".+-[a-z0-9]{10}$")


def kubernetes(alerts_path, *paths):
    alerts = yaml.safe_load(Path(alerts_path).read_text())["groups"]
    forms = set()
    count = 0
    for path in paths:
        by_kind = rendered(path)
        count += sum(len(docs) for docs in by_kind.values())
        forms |= kubernetes_overlay(Path(path).stem, by_kind, alerts)
    if forms != {"native sidecar", "two containers"}:
        problem(f"Deployment forms found: {sorted(forms)}; want the native sidecar and two containers")
    finish(f"{len(paths)} overlays, {count} manifests: they agree (selectors, ports, Secret keys, volumes, "
           f"the PrometheusRule is alerts.yml), and every container is hardened")


def kubernetes_own(alerts_path, path):
    by_kind = rendered(path)
    alerts = yaml.safe_load(Path(alerts_path).read_text())["groups"]
    forms = kubernetes_overlay(Path(path).stem, by_kind, alerts)
    count = sum(len(docs) for docs in by_kind.values())
    finish(f"{Path(path).stem} ({', '.join(sorted(forms))}), {count} manifests: they agree and are hardened")


def kubernetes_overlay(file, by_kind, alerts):
    """Checks one rendered overlay; returns the Deployment forms it has."""
    secrets = {d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {}))
               for d in by_kind.get("Secret", [])}
    configmaps = {d["metadata"]["name"] for d in by_kind.get("ConfigMap", [])}
    deployments = by_kind.get("Deployment", [])
    if len(deployments) != 1:
        problem(f"{file}: {len(deployments)} Deployments, not 1")
    forms = set()
    for deployment in deployments:
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
        proxies = [c for c in containers if is_idemproxy(c) and "serve" in c.get("args", [])]
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
                    problem(f"{where}: {env['name']} names {ref['name']}/{ref['key']}, which the Secret lacks")
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
                problem(f"{where}: /etc/idemproxy is not a ConfigMap of the overlay")
            elif not HASHED.fullmatch(config):
                problem(f"{where}: /etc/idemproxy is ConfigMap {config}, whose name has no content hash "
                        "(a config change would not roll the pods)")
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
        for app in (c for c in pod["containers"] if not is_idemproxy(c)):
            where = f"{file}: container {app['name']}"
            if app.get("ports"):
                problem(f"{where} declares ports; the app is reached through idemproxy only")
            binds = [a for a in app.get("command", []) + app.get("args", []) if re.fullmatch(r"[\d.]+:\d+", a)]
            if not binds or not all(a.startswith("127.0.0.1:") for a in binds):
                problem(f"{where} does not listen on loopback only: {binds}")
        migrations = [c for c in pod.get("initContainers", []) if "migrate" in c.get("args", [])]
        if not migrations:
            problem(f"{file}: no init container runs idemproxy migrate")
        for service in by_kind.get("Service", []):
            if not subset(service["spec"]["selector"], labels):
                problem(f"{file}: Service {service['metadata']['name']} selects no pod of the Deployment")
            for port in service["spec"]["ports"]:
                if port["targetPort"] not in ports:
                    problem(f"{file}: Service targetPort {port['targetPort']} is no port of the Deployment")
        for kind in ("PodDisruptionBudget", "NetworkPolicy"):
            for other in by_kind.get(kind, []):
                selector = other["spec"].get("selector") or other["spec"].get("podSelector")
                if not subset(selector["matchLabels"], labels):
                    problem(f"{file}: {kind} selects no pod of the Deployment")
                for rule in other["spec"].get("ingress", []):
                    for port in rule.get("ports", []):
                        if port["port"] not in ports:
                            problem(f"{file}: {kind} port {port['port']} is no port of the Deployment")
    services = by_kind.get("Service", [])
    monitors = by_kind.get("ServiceMonitor", [])
    for monitor in monitors:
        matched = [s for s in services if subset(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        if not matched:
            problem(f"{file}: the ServiceMonitor selects no Service")
        for endpoint in monitor["spec"]["endpoints"]:
            if not any(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in matched):
                problem(f"{file}: ServiceMonitor port {endpoint['port']} is no port of the Service")
    rules = by_kind.get("PrometheusRule", [])
    for rule in rules:
        if rule["spec"].get("groups") != alerts:
            problem(f"{file}: the PrometheusRule's groups are not those of deploy/prometheus/alerts.yml "
                    "(run deploy/kubernetes/prometheusrule)")
        # A kube-prometheus-stack Prometheus selects both by the same label.
        release = rule["metadata"].get("labels", {}).get("release")
        if any(m["metadata"].get("labels", {}).get("release") != release for m in monitors):
            problem(f"{file}: the PrometheusRule's release label {release!r} is not the ServiceMonitor's")
    for kind in ("ServiceMonitor", "PrometheusRule", "PodDisruptionBudget", "NetworkPolicy", "Service", "Secret"):
        if not by_kind.get(kind):
            problem(f"{file}: no {kind}")
    return forms


def unknown_fields(given, known, path):
    """The fields of `given` that `known` (the same document as a schema's model dumps it) lacks."""
    found = []
    if isinstance(given, dict):
        for key, value in given.items():
            if not isinstance(known, dict) or key not in known:
                found.append(f"{path}.{key}")
            else:
                found += unknown_fields(value, known[key], f"{path}.{key}")
    elif isinstance(given, list) and isinstance(known, list):
        for i, (one, other) in enumerate(zip(given, known)):
            found += unknown_fields(one, other, f"{path}[{i}]")
    return found


def operator_crds(*paths):
    """kubernetes-validate has no schema for the Prometheus Operator's kinds: validates them against the
    operator's CRD schemas as cloudcoil's generated models carry them (types, patterns, enums), and, as
    --strict does, rejects a field the schema does not have (the model drops it on the way through)."""
    import pydantic
    from cloudcoil.models.prometheus_operator import v1

    count = 0
    for path in paths:
        for kind in ("ServiceMonitor", "PrometheusRule"):
            for doc in rendered(path).get(kind, []):
                where = f"{Path(path).stem}: {kind} {doc['metadata']['name']}"
                count += 1
                try:
                    model = getattr(v1, kind).model_validate(doc)
                except pydantic.ValidationError as e:
                    problem(f"{where}: {e}")
                    continue
                known = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
                for field in unknown_fields(doc, known, ""):
                    problem(f"{where}: unknown field {field}")
    finish(f"{count} ServiceMonitors and PrometheusRules match the Prometheus Operator's schemas, no field unknown")


def mounted_config(by_kind):
    """The ConfigMap the idemproxy container mounts at /etc/idemproxy, and the Deployment's pod template."""
    deployment = by_kind["Deployment"][0]
    pod = deployment["spec"]["template"]["spec"]
    for container in pod.get("initContainers", []) + pod["containers"]:
        if "serve" in container.get("args", []):
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            volume = next(v for v in pod["volumes"] if v["name"] == mounts["/etc/idemproxy"])
            name = volume["configMap"]["name"]
            configmap = next(c for c in by_kind["ConfigMap"] if c["metadata"]["name"] == name)
            return configmap, deployment["spec"]["template"]
    sys.exit("no container serves")


def configmap_toml(path, out):
    configmap, _ = mounted_config(rendered(path))
    Path(out).write_text(configmap["data"]["idemproxy.toml"])


def config_rolls(before_path, after_path):
    """BEFORE and AFTER render one overlay before and after an edit of idemproxy.toml: the pod template
    changes (so the Deployment rolls), and only in the name of the ConfigMap it mounts."""
    before_map, before = mounted_config(rendered(before_path))
    after_map, after = mounted_config(rendered(after_path))
    old, new = before_map["metadata"]["name"], after_map["metadata"]["name"]
    if before_map["data"] == after_map["data"]:
        problem("the edit did not change the ConfigMap's data")
    if before == after:
        problem(f"the pod template is the same after the config changed (ConfigMap {old} both times)")
    elif json.loads(json.dumps(before).replace(json.dumps(old), json.dumps(new))) != after:
        problem("the pod template changed in more than the ConfigMap's name")
    finish(f"{Path(before_path).stem}: a changed idemproxy.toml changes the pod template: ConfigMap {old} -> {new}")


def prometheusrule_groups(path, out):
    """Writes the rendered PrometheusRule's groups as a rule file, for promtool."""
    rule = rendered(path)["PrometheusRule"][0]
    Path(out).write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))


def main():
    command, *args = sys.argv[1:]
    {
        "alerts-tested": alerts_tested,
        "dashboard-exprs": dashboard_exprs,
        "metric-refs": lambda metrics, *files: metric_refs(metrics, files),
        "metrics-table": metrics_table,
        "kubernetes": kubernetes,
        "configmap-toml": configmap_toml,
        "kubernetes-own": kubernetes_own,
        "operator-crds": lambda *paths: operator_crds(*paths),
        "config-rolls": config_rolls,
        "prometheusrule-groups": prometheusrule_groups,
    }[command](*args)


if __name__ == "__main__":
    main()
